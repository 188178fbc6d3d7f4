"""Metadata for the kernel inventory: backends, platforms, capability requirements, kernel specs.

Standard library only, so that the inventory can be imported and listed on a machine without torch
(``python -c "import torch_kernels.registry"`` never imports torch, a kernel framework or a GPU driver).
torch is imported inside :meth:`Platform.detect` only, and the callable behind a :class:`KernelSpec`
is imported by :meth:`KernelSpec.load` only, on first use.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

#: the package's version (``torch_kernels.__version__``): here, so that the core reads it without the package
__version__ = "0.1.0"


class Backend(str, enum.Enum):
    """Who implements a kernel. New backends (CUDA C++, CuTe DSL, ...) are added here."""

    TORCH = "torch"  # torch-native reference: the semantics, and the fallback on every device
    TRITON = "triton"
    TILELANG = "tilelang"
    FLASHINFER = "flashinfer"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str) -> "Backend":
        """The backend called ``name``; a clear ``ValueError`` listing the known ones otherwise."""
        try:
            return cls(name.strip().lower())
        except ValueError:
            known = ", ".join(b.value for b in cls)
            raise ValueError(f"unknown backend {name!r}; known backends: {known}") from None


#: The Python package each backend needs, checked with ``importlib.util.find_spec`` (no import).
FRAMEWORK_PACKAGE = {
    Backend.TORCH: "torch",
    Backend.TRITON: "triton",
    Backend.TILELANG: "tilelang",
    Backend.FLASHINFER: "flashinfer",
}


@dataclass(frozen=True)
class Platform:
    """The accelerator this process runs on. ``Platform()`` is a CPU-only machine."""

    device_type: str = "cpu"  # "cuda", "hip" or "cpu"
    compute_capability: Optional[Tuple[int, int]] = None  # (9, 0) for an H100/H200
    device_name: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @classmethod
    def detect(cls) -> "Platform":
        """The platform of the current process. Never raises: anything unexpected means CPU.

        Reading the compute capability initialises CUDA in this process; the dispatcher calls this
        on the first CUDA call of an op (CUDA is initialised by then), never at import, so an engine
        can still fork its workers after ``import torch_kernels``.
        """
        try:
            import torch

            if not torch.cuda.is_available():
                return cls()
            if getattr(torch.version, "hip", None):
                return cls(device_type="hip", device_name=torch.cuda.get_device_name())
            return cls(
                device_type="cuda",
                compute_capability=tuple(torch.cuda.get_device_capability()),
                device_name=torch.cuda.get_device_name(),
            )
        except Exception:
            return cls()

    def __str__(self) -> str:
        if self.compute_capability is None:
            return self.device_type
        major, minor = self.compute_capability
        return f"{self.device_type} sm_{major}{minor} ({self.device_name})"


@dataclass(frozen=True)
class Capability:
    """What a kernel needs to run: a device type, a compute-capability range, a framework package."""

    device_types: Tuple[str, ...] = ()  # empty: any device
    min_compute_capability: Optional[Tuple[int, int]] = None
    max_compute_capability: Optional[Tuple[int, int]] = None
    package: Optional[str] = None  # importable name, e.g. "triton"

    def unmet(self, platform: Platform) -> Optional[str]:
        """Why this capability is not met on ``platform``, or ``None`` when it is."""
        if self.device_types and platform.device_type not in self.device_types:
            return f"needs {'/'.join(self.device_types)}, this is {platform.device_type}"
        cc = platform.compute_capability
        if cc is not None:
            if self.min_compute_capability and cc < self.min_compute_capability:
                return f"needs compute capability >= {_cc(self.min_compute_capability)}, this is {_cc(cc)}"
            if self.max_compute_capability and cc > self.max_compute_capability:
                return f"needs compute capability <= {_cc(self.max_compute_capability)}, this is {_cc(cc)}"
        return self.missing_package()

    def missing_package(self) -> Optional[str]:
        """Why the framework package is missing, or ``None`` when it is importable (not imported)."""
        if self.package is None:
            return None
        try:
            found = importlib.util.find_spec(self.package) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"package {self.package!r} is not installed"


def _cc(cc: Tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


#: :attr:`HostCall.roles`: rows shaped like the data argument, a vector of its last dimension, a float >= 0
#: and one whose value is part of the signature too (a kernel specialised on it); a tensor of the call's
#: tokens and one of a fixed shape, each passed as it is (strided); an optional one-element float32 tensor
#: (a static scale), passed when given; an int, a bool and a string, whose values are part of the
#: signature and are not passed
HOST_ROLES = {"r": "rows", "w": "vector", "f": "float", "e": "float in the signature", "t": "token tensor",
              "c": "fixed tensor", "o": "optional scalar", "i": "int", "b": "bool", "s": "string"}
#: the roles whose argument the host function does not take (the compiled function is specialised on it)
HOST_FIXED = ("i", "b", "s")
#: :attr:`HostCall.output`: none (in place), rows like the data argument, rows of half its last dimension,
#: the schema's returns laid out as the host publishes them with each signature (:attr:`HostKernels.outputs`)
HOST_OUTPUTS = {"": "none", "r": "rows", "h": "half rows", "p": "published"}
#: :attr:`HostKernels.outputs` layouts over the rows of the data argument's leading dims (T tokens in all),
#: each with how the host function takes it: ``(*lead, width)`` contiguous as ``(T, width)``; ``(*lead, 1)``
#: as ``(T,)``; ``(1,)``; ``(*lead, width)`` over storage ``(width, *lead)`` (column-major) as ``(T, width)``;
#: and ``like``, contiguous in the shape of the ``t`` argument whose index stands for the width, as it is
OUTPUT_LAYOUTS = ("rows", "token", "one", "column", "like")


@dataclass(frozen=True)
class HostCall:
    """How the C++ entry calls a backend's compiled host function for one op (``fast_path.py``).

    ``roles`` has one letter per schema argument (:data:`HOST_ROLES`): ``r`` rows shaped like the data
    argument (the first ``r``, else the first ``t``), ``w`` a 1-D vector of its last dimension (both
    contiguous and 16-byte aligned; a ``Tensor?`` one passed as ``None`` sends the call to the Python
    kernels), ``f`` a float that must be >= 0, passed by value, ``e`` the same with its value part of the
    signature; ``t`` a tensor of one to three dimensions whose first is the call's tokens, and ``c`` a 2-D
    tensor of a fixed shape, each passed with its own strides (its last one 1), its trailing (``t``) or
    whole (``c``) shape part of the signature, its data pointer and strides multiples of the granule its
    host publishes; ``o`` an optional one-element
    float32 tensor, whether given part of the signature, passed as ``(1,)`` when given and left out of the
    host function's arguments when not; ``i`` an int, ``b`` a bool and ``s`` a string, part of the
    signature and not passed. ``output`` is what the entry allocates (:data:`HOST_OUTPUTS`). ``order`` is
    the host function's arguments: every passed argument's index once, ``-1 - k`` for output ``k``
    (``-1`` alone but for ``p``).
    """

    roles: str
    output: str = ""
    order: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = [r for r in self.roles if r not in HOST_ROLES]
        if bad or not ("r" in self.roles or "t" in self.roles):
            raise ValueError(f"HostCall: roles must be letters of {''.join(HOST_ROLES)} with at least one 'r' or 't', "
                             f"got {self.roles!r}")
        if self.output not in HOST_OUTPUTS:
            raise ValueError(f"HostCall: output must be one of {tuple(HOST_OUTPUTS)}, got {self.output!r}")
        if self.output and self.output != "p" and "r" not in self.roles:
            raise ValueError(f"HostCall: an output is shaped like rows: roles must hold an 'r', got {self.roles!r}")
        outputs = -min(self.order, default=0) if self.output == "p" else 1 if self.output else 0
        wanted = list(range(-outputs, 0)) + [i for i, r in enumerate(self.roles) if r not in HOST_FIXED]
        if not isinstance(self.order, tuple) or sorted(self.order) != wanted or (self.output == "p" and not outputs):
            raise ValueError(f"HostCall: order must hold each of {wanted} once, got {self.order!r}")

    @property
    def data(self) -> int:
        """The data argument: the first rows, else the first token tensor."""
        return self.roles.index("r") if "r" in self.roles else self.roles.index("t")

    @property
    def tensors(self) -> Tuple[int, ...]:
        """The tensor arguments' indices, in schema order."""
        return tuple(i for i, r in enumerate(self.roles) if r in "rwtc")


@dataclass(frozen=True)
class HostKernels:
    """What a ``host`` returns for a call the C++ entry may serve: the compiled host functions, each with
    the token count from which it serves (``((0, fn), (from_tokens, fn), ...)``, ascending, at most
    four), and per schema argument the granule, in elements, that a ``t`` or ``c`` tensor's data pointer
    and strides must be multiples of for these functions (``0``: none; other roles ``0``); for an op
    whose :attr:`HostCall.output` is ``p``, per output its ``(layout, dtype, width)`` (:data:`OUTPUT_LAYOUTS`;
    width 1 for ``token`` and ``one``); the most tokens a call of these functions may have (``0``: no
    limit). A host may also return the pairs alone (no granules, no outputs), or ``()`` for a call it
    does not publish."""

    kernels: Tuple[Tuple[int, Any], ...]
    granules: Tuple[int, ...] = ()
    outputs: Tuple[Tuple[str, Any, int], ...] = ()
    max_tokens: int = 0


@dataclass(frozen=True)
class KernelSpec:
    """One implementation of one op by one backend.

    ``target`` is ``"module:attr"``, imported by :meth:`load` on first use. ``dtypes`` lists the
    dtype names the implementation accepts for the op's data tensor (empty: every dtype the op
    accepts); a call with another dtype goes to the next backend. ``check`` optionally names a
    ``"module:attr"`` callable taking the op's arguments and returning why this implementation
    cannot take the call (size limit, alignment), or ``None``. ``host`` optionally names a ``"module:attr"``
    callable taking the op's arguments and returning ``((0, fn), (from_tokens, fn), ...)`` or a
    :class:`HostKernels`: the compiled host functions for calls like these, each with the token count
    from which it serves (ascending, at most four); ``host_call`` says how the C++ entry calls them. ``out``: the function takes the op's
    ``out`` overload's tensors as the keyword ``out`` (a tuple in the schema's order; ``None`` for the
    default overload) and writes its results there itself, as :mod:`torch_kernels.outputs` says.
    """

    op: str
    backend: Backend
    target: str
    capability: Capability = field(default_factory=Capability)
    dtypes: Tuple[str, ...] = ()
    check: Optional[str] = None
    description: str = ""
    # samples from the reference's kept set with its own random stream: held to the kept set, not the ids
    own_random_stream: bool = False
    host: Optional[str] = None
    host_call: Optional[HostCall] = None
    out: bool = False

    def __post_init__(self) -> None:
        for t in (self.target, self.check, self.host):
            if t is not None and (":" not in t or not all(t.split(":", 1))):
                raise ValueError(f"KernelSpec({self.op!r}, {self.backend.value!r}): target must be 'module:attr', got {t!r}")
        if (self.host is None) != (self.host_call is None) or not isinstance(self.host_call, (HostCall, type(None))):
            raise ValueError(f"KernelSpec({self.op!r}, {self.backend.value!r}): host and host_call (a HostCall) go "
                             f"together, got {self.host!r} and {self.host_call!r}")

    @property
    def restricted(self) -> bool:
        """Whether some calls the op accepts are refused (a dtype list or a per-call check)."""
        return bool(self.dtypes) or self.check is not None

    def unavailable_reason(self, platform: Platform) -> Optional[str]:
        """Why this implementation cannot run on ``platform`` (metadata only), or ``None``."""
        return self.capability.unmet(platform)

    def is_available(self, platform: Platform) -> bool:
        return self.unavailable_reason(platform) is None

    def load(self) -> Callable[..., Any]:
        """Import and return the implementation (raises ``ImportError``/``AttributeError``)."""
        return _resolve(self.target)

    def load_check(self) -> Optional[Callable[..., Optional[str]]]:
        return None if self.check is None else _resolve(self.check)

    def load_host(self) -> Optional[Callable[..., Tuple[Tuple[int, Any], ...]]]:
        return None if self.host is None else _resolve(self.host)


def _resolve(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# Compiled routes: what an op becomes below Dynamo's one node when torch.compile traces it on CUDA
# (docs/compile.md; the measurements behind each op's route: docs/design/compile.md).
#: The reference formula, inlined, so that Inductor fuses the op with its neighbours.
DECOMPOSE = "decompose"
#: Our Triton kernel, launched by Inductor itself (``torch.library.wrap_triton``, as in ``triton_op``);
#: Inductor cannot fuse into a user kernel, so the neighbours stay separate kernels.
INDUCTOR_TRITON = "inductor_triton"
#: One opaque call to the backend ``dispatch.plan`` selects, as in eager mode.
OPAQUE = "opaque"
COMPILE_ROUTES: Tuple[str, ...] = (DECOMPOSE, INDUCTOR_TRITON, OPAQUE)


@dataclass(frozen=True)
class OpInfo:
    """What the inventory records of one op beside its implementations: its route under ``torch.compile``
    (one of ``registry.COMPILE_ROUTES``), when that changes, the routes it cannot take, and its CUDA order.

    ``compile_route`` is taken where no pointwise op computes the data input (alone, after a matmul);
    ``decompose_after_pointwise`` decomposes instead where one does, so that Inductor fuses that producer
    into the formula. ``no_compile_route`` maps a route to why the op cannot take it; ``opaque_off_cuda``
    keeps the op opaque on devices other than CUDA, where every route runs the reference.
    ``cuda_priority`` replaces ``registry.DEFAULT_CUDA_PRIORITY`` for this op."""

    name: str
    compile_route: str
    decompose_after_pointwise: bool = False
    no_compile_route: Tuple[Tuple[str, str], ...] = ()  # (route, why)
    opaque_off_cuda: bool = False
    cuda_priority: Optional[Tuple[Backend, ...]] = None


@dataclass(frozen=True)
class Family:
    """One op family's manifest (``torch_kernels/families/<name>/manifest.py``): its ops and every
    implementation of them. ``package`` is the family's package; its ``ops`` module holds the op
    definitions (schema, validation, fake, samples), which need torch, so the inventory never imports it.
    ``notes``: what the inventory says under its table, such as why a backend that has an op is no
    implementation of it."""

    package: str
    ops: Tuple[OpInfo, ...]
    kernels: Tuple[KernelSpec, ...]
    notes: Tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.package.rpartition(".")[2]

    @property
    def definitions(self) -> str:
        return f"{self.package}.ops"
