"""``python -m minidist.models.pretrained --export NAME [--out DIR]``: remake the shipped weights."""

from minidist.models.pretrained.loading import main

raise SystemExit(main())
