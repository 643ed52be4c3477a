"""Building blocks of the training patterns: variable-length messages, any-source receive."""

from .inbox import Inbox
from .messages import recv_rows, send_rows

__all__ = ["Inbox", "recv_rows", "send_rows"]
