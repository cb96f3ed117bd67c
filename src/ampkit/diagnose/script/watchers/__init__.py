"""One watcher per thing the script doctor observes, each a ``Watcher`` (``watchers.base``), all
registered in ``WATCHERS``: the ``Context`` builds one of each, in this order, and installs them in it.

The order matters only where two watchers hook the same event: the scaler watcher's optimizer
pre-step hook runs before the optimizer watcher's, so that a direct ``optimizer.step()`` is
reported before that step's gradients are checked (a check that may replay the step).
"""

from ampkit.diagnose.script.watchers.autocast import AutocastWatch
from ampkit.diagnose.script.watchers.backward import BackwardWatch
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.diagnose.script.watchers.casts import CastWatch
from ampkit.diagnose.script.watchers.compile import CompileWatch
from ampkit.diagnose.script.watchers.engine import EngineWatch
from ampkit.diagnose.script.watchers.fork import ForkWatch
from ampkit.diagnose.script.watchers.frameworks import FrameworkWatch
from ampkit.diagnose.script.watchers.io import CheckpointWatch
from ampkit.diagnose.script.watchers.optim import OptimWatch
from ampkit.diagnose.script.watchers.penalty import GradPenaltyWatch
from ampkit.diagnose.script.watchers.scaler import ScalerWatch

__all__ = ["WATCHERS", "Watcher"]

WATCHERS: tuple[type[Watcher], ...] = (
    AutocastWatch,
    CastWatch,
    FrameworkWatch,
    ScalerWatch,
    OptimWatch,
    BackwardWatch,
    GradPenaltyWatch,
    CheckpointWatch,
    CompileWatch,
    EngineWatch,
    ForkWatch,
)
"""Every watcher, in install order."""
