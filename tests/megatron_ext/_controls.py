"""Controls shared by the cross-micro-batch tests: what a wrong gradient rule looks like."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def blocks_take_no_gradients() -> Iterator[None]:
    """Wrong: every block's backward step takes in none of its readers' accumulated gradients
    (neither through a kept graph's gradient term nor injected into a recomputed block's K/V),
    so the shared prefix's gradients miss every reader's share."""
    from prefix_sharing import prefix_kv

    with mock.patch.object(prefix_kv, "gradient_of",
                           lambda recorded, leaf: (recorded * 0).sum()), \
            mock.patch.object(prefix_kv, "read_through", lambda recorded, leaf: recorded):
        yield
