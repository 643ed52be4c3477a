"""``python -m minidist.parallel.offload ARGS_JSON``: the RSS measurement's child process.

``measure.measure_rss_growth`` starts it, so that the caller's own allocations do not blur the peak;
it prints ``_rss_growth_here``'s dict as one JSON line.
"""

import json
import sys

from .measure import _rss_growth_here

print(json.dumps(_rss_growth_here(**json.loads(sys.argv[1]))))
