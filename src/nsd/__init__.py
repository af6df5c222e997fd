"""nsd — Nucleus Speculative Decoding.

Speculative decoding whose verifier also accepts a draft token lying in the target's
nucleus, with the total-variation cost of every relaxed acceptance computed exactly.
"""

from nsd.errors import NSDError

__all__ = ["NSDError"]
__version__ = "0.1.0"
