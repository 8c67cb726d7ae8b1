"""Distributed contrastive losses (gather, disco, ring, fastclip) and DDP gradient communication.

See docs/distributed.md. Process-group helpers and the communication ledger live in toolkit.core.dist.
"""

from toolkit.train.dist.ddp import GRAD_DTYPES, grad_sync, unwrap, wrap_ddp
from toolkit.train.dist.losses import MODES, contrastive_loss, mean_over_ranks

__all__ = ["GRAD_DTYPES", "MODES", "contrastive_loss", "grad_sync", "mean_over_ranks", "unwrap", "wrap_ddp"]
