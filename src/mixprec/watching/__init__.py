"""mixprec.watch: the doctor inside the user's own training loop (plain PyTorch, Hugging Face, Lightning).

``with mixprec.watch(model, optimizer, scaler=scaler, out="watch") as w:`` around an unchanged loop keeps
per-step numbers on the device (loss scale, skips, non-finite steps), samples every ``every`` steps (per-layer
ranges, lost updates, gradient norms), and on a fault replays the step on a copy to name the first
non-finite op, its module and phase, and the modules to keep in fp32 (:mod:`.recorder`) -- also where the loop
skipped the step itself. See
:mod:`.core` for what it hooks and what it costs, :mod:`.output` for what it writes.
"""

from .api import watch
from .config import WatchConfig, WatchError
from .core import Watch
from .recorder import analyze_capture, load_capture

__all__ = ["watch", "Watch", "WatchConfig", "WatchError", "analyze_capture", "load_capture"]
