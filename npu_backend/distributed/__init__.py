"""Scale-out of the public API on Ray: dataset evaluation (``npu eval``) and design-space sweeps (``npu sweep``).

Nothing in the compiler or the simulator knows about Ray. Work is cut into tasks (a shard of a dataset, one
model x preset x quantization combination); :mod:`.executor` runs them in this process or as Ray tasks (a local
Ray started on demand, or a cluster by address) and is the only module that imports Ray. A compiled model holds
command streams registered in the process that compiled it, so it never travels: the model file's bytes do,
and each worker process compiles once and keeps the result for every later task (:mod:`.model_files`).
Results come back in task order, whatever finished first, so a distributed run equals the serial one; with a
resume directory (:mod:`.shards`) finished tasks are kept on disk and a rerun does only the rest.
"""

from .evaluation import Evaluation, evaluate
from .executor import ray_available
from .grid import Grid, load_grid
from .sweep import Sweep, sweep

__all__ = ["evaluate", "Evaluation", "sweep", "Sweep", "Grid", "load_grid", "ray_available"]
