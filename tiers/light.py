"""Light checkpoints (--light-every N): every N steps, the model's weights alone, as one file that a plain
torch.load reads (the keys of the unwrapped model's state_dict, as --export writes them), for an
evaluation job or a look at the run; rank 0's light/step-NNNNNNNN.pt, committed by its rename,
--light-keep of them kept. Never a resume's: it looks in ckpt/ only. A tier of the checkpointer
(common/checkpointer.py): imported only when the flag is set."""
import time
from pathlib import Path

from common.checkpoint import atomic_save, prune, step_name
from common.config import fail
from common.dist import agree


class LightCheckpoints:
    def __init__(self, cfg):
        self.every, self.keep, self.folder = cfg.light_every, cfg.light_keep, Path(cfg.run_dir) / "light"

    def after_step(self, step, checkpointer):
        """Write the light checkpoint of `step` if it is due. A failed write stops the job as a failed save
        does (exit 3)."""
        if step % self.every:
            return
        t0, error, nbytes, rank = time.perf_counter(), None, 0, checkpointer.rank
        weights = checkpointer.full_weights()  # FSDP: gathered, a collective
        if rank == 0:
            try:
                self.folder.mkdir(exist_ok=True)
                nbytes = atomic_save({k: v.detach().cpu() for k, v in weights.items()},
                                     self.folder / step_name(step, ".pt"))
                prune(self.folder, self.keep, step)
            except OSError as e:
                error = e
        if not agree(error is None, checkpointer.device):
            fail(f"saving the light checkpoint of step {step} failed ({getattr(error, 'strerror', None) or error})"
                 if rank == 0 else None, code=3)
        checkpointer.monitor.event("light", step=step, bytes=nbytes, blocking_s=time.perf_counter() - t0)
