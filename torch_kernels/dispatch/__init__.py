"""Selection: which backend serves each op on the CUDA dispatch key.

The semantics of the DeepInfer kernel dispatcher, applied to ops:

* Platform default: per op, the backends of ``registry.cuda_priority(op)`` whose capability is met
  here; the first serves the op, the later ones take the calls it refuses (dtype, size). On every
  other device the torch reference serves (``library.py`` registers it there).
* ``DEEPINFER_OPS_BACKEND=<backend>``: every op from that backend. An op it lacks (no implementation,
  or one this platform cannot run) comes from the platform default: one stderr line at import says
  how many (all names with ``DEEPINFER_OPS_VERBOSE=1``), and one line at the first *use* of each
  such op names it.
* ``DEEPINFER_OPS_BACKEND=auto``: every call of an op from the backend measured fastest for its shape
  bucket on this GPU (``tuning.py``, ``python -m torch_kernels tune``), the platform default's order
  behind it; with no usable table for this GPU the platform default serves, and one line says why.
* ``DEEPINFER_OPS_FALLBACK=op,op``: those ops come from the platform default even when another backend
  is selected. A name that is not an op, or that the selected backend does not implement, raises.
* ``DEEPINFER_OPS_STRICT=1``: no fallback of any kind. The default backend is never imported; an op
  the selected backend lacks, or a call it refuses, raises :class:`KernelUnavailableError`. STRICT
  with FALLBACK raises.
* ``DEEPINFER_TRACE_KERNELS=path``: the first use of each (op, backend) on each device type appends a
  line ``op|backend`` to ``path`` (the reference serving CPU included: :class:`ReferenceSlot`);
  ``DEEPINFER_TRACE_KERNEL_ARGS=1`` adds the argument signature (never tensor data). A path that
  cannot be written gives one notice and traces nothing more; an op call never raises for it.
* ``DEEPINFER_OPS_COMPILE_ROUTE=route`` or ``op=route,...`` (both: ``opaque,rmsnorm=decompose``): the
  route under ``torch.compile`` (``registry.COMPILE_ROUTES``) for every op, or for the ops named,
  instead of each op's measured ``registry.COMPILE_ROUTE``; see :func:`compile_route`.

:func:`configure` does all of it from Python. A misconfiguration raises ``ValueError`` naming the
variable, or the argument of :func:`configure` (``configure(backend=...)``) that set it. Resolution
happens on the first CUDA call of an op, under a lock (the first calls from several threads select and
load once), not at import: reading the compute capability initialises CUDA, and engines fork their
workers after importing us.

The modules, each importing only ones named before it: ``settings`` (the variables, :class:`Selection`,
the current selection and platform), ``trace`` (the trace file), ``planning`` (:func:`plan`),
``compile_routes`` (:func:`compile_route`), ``slots`` (what each op's entry calls), ``control``
(:func:`configure`, :func:`set_platform`).
"""

from .settings import (AUTO, ENV_BACKEND, ENV_CHECK_INDICES, ENV_COMPILE_ROUTE, ENV_FALLBACK, ENV_OF, ENV_STRICT, ENV_TRACE,
                       ENV_TRACE_ARGS, ENV_VERBOSE, KernelUnavailableError, Selection, parse_compile_route,
                       platform, selection)
from .trace import append_line
from .planning import plan
from .compile_routes import compile_route, note_compile_route
from .slots import (Implementation, OpSlot, ReferenceSlot, auto_function, on_new_selection, reference_slot, slot,
                    tuned_table)
from .control import configure, set_platform

__all__ = [
    "AUTO", "ENV_BACKEND", "ENV_CHECK_INDICES", "ENV_COMPILE_ROUTE", "ENV_FALLBACK", "ENV_OF", "ENV_STRICT", "ENV_TRACE",
    "ENV_TRACE_ARGS", "ENV_VERBOSE", "Implementation", "KernelUnavailableError", "OpSlot", "ReferenceSlot", "Selection",
    "append_line", "auto_function", "compile_route", "configure", "note_compile_route", "on_new_selection", "parse_compile_route",
    "plan", "platform", "reference_slot", "selection", "set_platform", "slot", "tuned_table",
]

configure(Selection.from_env())
