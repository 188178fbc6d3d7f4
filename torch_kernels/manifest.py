"""What a family's ``manifest.py`` is written with: the capability of each backend, and one call per
backend that lists the ops it implements. Standard library only (see ``spec.py``).

A kernel lives at ``<family package>.<module>:<op>``, the module named after its backend
(``reference``, ``triton``, ``tilelang``, ``flashinfer``); with ``checks``, ``<op>_refuses`` in that
module turns away the calls it cannot take (a size limit, an alignment); with ``host_calls``, ``<op>_host``
returns the compiled host functions the C++ entry calls for that op, as its :class:`HostCall` says;
the ops of ``out_ops`` take their ``out`` overload's tensors (``KernelSpec.out``).
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

from .spec import FRAMEWORK_PACKAGE, Backend, Capability, HostCall, KernelSpec

#: where each backend's kernels of a family live in the family's package
MODULE = {Backend.TORCH: "reference", Backend.TRITON: "triton", Backend.TILELANG: "tilelang", Backend.FLASHINFER: "flashinfer"}

CAPABILITY = {
    Backend.TORCH: Capability(),  # the reference runs wherever torch does
    Backend.TRITON: Capability(device_types=("cuda",), min_compute_capability=(7, 0), package=FRAMEWORK_PACKAGE[Backend.TRITON]),
    Backend.TILELANG: Capability(device_types=("cuda",), min_compute_capability=(8, 0), package=FRAMEWORK_PACKAGE[Backend.TILELANG]),
    Backend.FLASHINFER: Capability(device_types=("cuda",), min_compute_capability=(8, 0),
                                   package=FRAMEWORK_PACKAGE[Backend.FLASHINFER]),
}

FLOATS = ("float16", "bfloat16", "float32")
HALF = ("float16", "bfloat16")


def kernels(package: str, backend: Backend, ops: Tuple[str, ...], description: str, dtypes: Tuple[str, ...] = FLOATS,
            checks: bool = False, own_random_stream: bool = False,
            host_calls: Optional[Mapping[str, HostCall]] = None, out_ops: Tuple[str, ...] = ()) -> Tuple[KernelSpec, ...]:
    """``backend``'s implementation of each of ``ops``, in ``package``'s module of that backend."""
    module = f"{package}.{MODULE[backend]}"
    host_calls = host_calls or {}
    for what, named in (("host_calls", host_calls), ("out_ops", out_ops)):
        unknown = set(named) - set(ops)
        if unknown:
            raise ValueError(f"{package}: {what} for ops it does not implement with {backend.value}: {sorted(unknown)}")
    return tuple(KernelSpec(op, backend, f"{module}:{op}", CAPABILITY[backend], dtypes,
                            check=f"{module}:{op}_refuses" if checks else None, description=description,
                            own_random_stream=own_random_stream,
                            host=f"{module}:{op}_host" if op in host_calls else None, host_call=host_calls.get(op),
                            out=op in out_ops)
                 for op in ops)


def reference(package: str, ops: Tuple[str, ...]) -> Tuple[KernelSpec, ...]:
    """The torch reference of each of ``ops``: every dtype the op accepts (fp64 included), every device."""
    return kernels(package, Backend.TORCH, ops, "torch-native reference (fp32 compute)", dtypes=())
