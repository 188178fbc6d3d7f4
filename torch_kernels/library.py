"""Registration: every op of ``ops.ALL`` in the ``deepinfer`` namespace of ``torch.library``.

Per op:
* ``CompositeExplicitAutograd``: the torch reference, so every device (CPU, MPS, XPU, ...) has an
  implementation, through its ``dispatch.ReferenceSlot`` (which traces it); the CUDA kernel below
  overrides it on CUDA only.
* ``CUDA``: the backend ``dispatch`` selects, through the op's slot.
* fake (``Meta`` and fake tensors): the op definition's fake function, so ``torch.compile`` traces
  the op as one node with dynamic shapes.
* ``Autograd``: the op's backward formula, or a clear error for the in-place ops.
* ``out`` overload (every op that returns tensors, aten's convention, :attr:`OpDef.out_schema`): the
  results in the given tensors, which it returns (an op that also writes an argument, as the fused-add
  FP8 norms their residual, still writes it, its outputs checked first). On CUDA, where the serving
  backend writes them itself (``KernelSpec.out``, :mod:`~torch_kernels.outputs`) and they are
  contiguous, aligned and apart from the inputs, its kernel writes there; otherwise, and on every
  other device, the default overload's result is copied into them, checked first (shape, dtype,
  device). Compiled: that copy into the graph's tensors.
* a ``FunctionalTensorMode`` rule: the op's compiled route (``registry.COMPILE_ROUTE``,
  ``dispatch.compile_route``). ``torch.compile`` functionalises its graph under that mode (in
  AOTAutograd, below Dynamo's one node per op), so the rule decides what Inductor receives: the
  reference formula (``decompose``), our Triton kernel through ``torch.library.wrap_triton``
  (``inductor_triton``, what ``torch.library.triton_op`` does inside), or the op itself
  (``opaque``). Eager calls never meet the mode.
With the C++ entry built (``fast_path.py``), the ``CUDA`` and ``Autograd`` kernels of the ops it serves
(``fast_path.serves``: a TileLang spec with a ``host`` in the op's manifest, or a Triton kernel whose
launches the entry records) are C++ ones; the Python kernels above move to a twin op
``deepinfer_py::<op>`` of the same schema, which the C++ kernels call for every call they do not serve
themselves.
Every entry validates its arguments with the op definition's ``validate`` before any kernel runs;
under ``torch.compile`` Dynamo has run the fake function, which validates, before the rule runs.

Route: ``Library.define`` + ``Library.impl``, measured on the H200 host at 5 µs per call over calling
the kernel directly, against 22 µs for ``torch.library.custom_op``.
"""

import functools
import operator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from . import checks as check, dispatch, fast_path, outputs, registry
from .ops import ALL, NAMESPACE, OpDef
from .spec import Backend

LIBRARY = torch.library.Library(NAMESPACE, "DEF")
#: the twins of the ops whose CUDA and Autograd kernels the C++ entry registers, when it is loaded
TWINS = torch.library.Library(fast_path.TWIN_NAMESPACE, "DEF") if fast_path.load() else None
dispatch.on_new_selection(fast_path.clear)  # what the C++ entry serves was published under the previous selection


def mutated_args(overload) -> tuple:
    """Indices of the arguments ``overload``'s schema marks as written (``Tensor(a!)``)."""
    return tuple(i for i, a in enumerate(overload._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _reference_entry(validate, slot: dispatch.ReferenceSlot):
    def reference_entry(*args):
        validate(*args)
        return slot.call(*args)  # looked up per call: the reference, or it behind the trace hook
    return reference_entry


def _cuda_entry(validate, slot: dispatch.OpSlot):
    def cuda_entry(*args):
        validate(*args)
        return slot.call(*args)  # looked up per call: the slot swaps it when it resolves
    return cuda_entry


def _offering_cuda_entry(op: OpDef, slot: dispatch.OpSlot):
    """The twin's CUDA kernel: the Python one, then the offer of this call's signature to the C++ entry."""
    validate = op.validate

    def cuda_entry(*args):
        checks_before = check.index_checks_run()
        validate(*args)
        out = slot.call(*args)
        if check.index_checks_run() == checks_before:  # a checked call's signature would be served unchecked
            fast_path.offer(op.name, slot.sole_server(args), args)
        return out
    return cuda_entry


def _recording_cuda_entry(name: str, entry, slot: dispatch.OpSlot):
    """The twin's CUDA kernel of an op the C++ entry serves by recorded launches (``name``: the op or
    ``op.out``): ``entry``, the Python one, recorded where the entry asks for it."""
    def recording_entry(*args, **outs):
        return fast_path.run_recording(name, entry, lambda: slot.signature_server(args), args, outs)
    return recording_entry


def _autograd_entry(op: OpDef, namespace: str = NAMESPACE):
    """The ``Autograd`` kernel of ``namespace::<op>`` (the op or its twin): the op's backward formula
    around the op's own device kernel (the C++ entry's, when built), or its refusal, when a gradient is
    requested; otherwise straight on to the device kernel of ``namespace::<op>``. Written out rather
    than through ``torch.library.register_autograd``, whose generic kernel measured 5.7 µs a call on
    the CPU machine against 4.5 for this one, with no gradient requested (the inference case)."""
    overload = getattr(getattr(torch.ops, namespace), op.name).default
    forward = getattr(getattr(torch.ops, NAMESPACE), op.name).default
    below_autograd = torch._C._after_autograd_keyset
    function = None
    if op.backward is not None:
        function = type(f"{op.name}_autograd", (torch.autograd.Function,), {
            "forward": staticmethod(lambda ctx, keyset, *args: _forward(ctx, op, forward, keyset & below_autograd, args)),
            "backward": staticmethod(lambda ctx, *grads: (None, *op.backward(ctx, *grads))),
        })

    def autograd_entry(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            if function is None:
                raise RuntimeError(f"{op.qualname} does not support autograd: {op.no_grad_reason}")
            return function.apply(keyset, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & below_autograd, *args)
    return autograd_entry


def _forward(ctx, op: OpDef, overload, keyset, args):
    with torch._C._AutoDispatchBelowAutograd():
        out = overload.redispatch(keyset, *args)
    op.setup_context(ctx, args, out)
    return out


@functools.lru_cache(maxsize=None)
def _written(op: OpDef) -> tuple:
    """Indices of the arguments ``op`` writes (``Tensor(a!)`` in its schema)."""
    return mutated_args(getattr(getattr(torch.ops, NAMESPACE), op.name).default)


def _traced_triton(op: OpDef, args: tuple):
    """The Triton implementation with its kernels launched through ``wrap_triton``, or ``None``
    when it refuses these arguments (dtype, size: the opaque call then falls back as in eager).

    Also ``None`` when a written argument is not contiguous: Inductor may hand the kernel a
    re-laid-out copy of such a view while the body read its strides when traced (rope on q and k as
    views of one QKV buffer: an illegal address at 4096 tokens, bench_compile.py, H200, torch 2.11)."""
    if any(args[i] is not None and not args[i].is_contiguous() for i in _written(op)):
        dispatch.note_compile_route(f"op {op.name!r} compiled as 'opaque', not 'inductor_triton', where it writes a "
                                    "non-contiguous view (Inductor may hand the kernel a copy laid out anew)")
        return None
    triton = _triton(op)
    if triton.refuses(args) is not None:
        return None
    return functools.partial(triton.fn, wrap=torch.library.wrap_triton)


@functools.lru_cache(maxsize=None)
def _triton(op: OpDef) -> dispatch.Implementation:
    return dispatch.Implementation(registry.BY_OP[op.name][Backend.TRITON], op.data_arg)


def _made_by_pointwise(t) -> bool:
    """Whether the graph being traced computes ``t`` (or the tensor it is a view or a copy of) with a
    pointwise op, which Inductor would fuse into the op's decomposition. Read from the proxy graph that
    AOTAutograd's tracer is building below the functional mode. A ``clone`` is looked through, as a
    view is: it copies, it computes nothing (``opcheck``'s AOT test clones its inputs; taken for
    pointwise, the decomposed ``per_token_group_quant_fp8`` rounded fp8 ties one step from the
    kernels' and failed the test's exact comparison on 13 of 140 samples)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    tracer = get_proxy_mode()
    if tracer is None or not isinstance(t, FunctionalTensor):
        return False
    found = get_proxy_slot(torch._from_functional_tensor(t.elem), tracer.tracer, None)
    node = found.proxy.node if found is not None else None
    while node is not None and (node.target is operator.getitem or node.target is torch.ops.aten.clone.default
                                or isinstance(node.target, torch._ops.OpOverload) and node.target.is_view):
        node = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    return node is not None and isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags


def _compile_rule(op: OpDef, reference):
    """The ``FunctionalTensorMode`` rule that applies the op's compiled route."""
    def rule(mode, overload, types, args, kwargs):
        if not all(t in (torch.Tensor, FunctionalTensor) or issubclass(t, FakeTensor) for t in types):
            return NotImplemented  # another tensor subclass: let it handle the op
        body = None
        # False while torch.export traces: the op stays one node, as a triton_op does there
        if getattr(torch._functorch.config, "decompose_custom_triton_ops", True):
            after_pointwise = op.name in registry.DECOMPOSE_AFTER_POINTWISE and _made_by_pointwise(args[op.data_arg])
            route, notice = dispatch.compile_route(op.name, args[op.data_arg].device.type, after_pointwise=after_pointwise)
            dispatch.note_compile_route(notice)
            if route == registry.DECOMPOSE:
                body = reference
            elif route == registry.INDUCTOR_TRITON:
                body = _traced_triton(op, args)
        if body is None:  # opaque: what the mode does with any op (auto_functionalize if it mutates)
            return mode.__torch_dispatch__(overload, types, args, kwargs)
        with mode:
            return body(*args, **kwargs)
    return rule


def _check_out(op: OpDef, name: str, out, want) -> None:
    """``out`` (the ``out`` overload's argument ``name``) takes ``want``, the default overload's result
    (sizes through ``checks.require``: symbolic ones trace)."""
    where = f"{op.name}.out"
    check.tensor(where, name, out)
    got = lambda: f"got {out.dtype} of shape {tuple(out.shape)} on {out.device}"  # noqa: E731
    expected = f"must be {want.dtype} of shape {tuple(want.shape)} on {want.device}, "
    check.require(out.dtype == want.dtype and out.device == want.device and out.dim() == want.dim(), where, name,
                  lambda: expected + got())
    for have, size in zip(out.shape, want.shape):
        check.require(have == size, where, name, lambda: expected + got())


def _out_entries(op: OpDef):
    """``(kernel, fake, autograd kernel)`` of the op's ``out`` overload."""
    default = getattr(getattr(torch.ops, NAMESPACE), op.name).default
    names = op.out_names

    def checked(results, outs) -> tuple:
        results = (results,) if len(names) == 1 else results
        for name, r in zip(names, results):
            _check_out(op, name, outs[name], r)
        return results

    def returned(outs):
        return outs[names[0]] if len(names) == 1 else tuple(outs[n] for n in names)

    written = mutated_args(default)

    def kernel(*args, **outs):
        # the call writes an argument: the outputs are checked before it runs, and kept off it (traced,
        # the fake function has checked them and nothing is written before the graph runs)
        if written and not _traced(args):
            checked(op.fake(*args), outs)
            for name in names:
                for i in written:
                    if i < len(args) and _meets(outs[name], args[i]):
                        check.fail(f"{op.name}.out", name, f"must not share memory with the written argument "
                                   f"'{default._schema.arguments[i].name}'")
        for name, r in zip(names, checked(default(*args), outs)):  # every output checked before any is written
            outs[name].copy_(r)
        return returned(outs)

    def fake(*args, **outs):
        checked(op.fake(*args), outs)
        return returned(outs)

    return kernel, fake, _out_autograd_entry(op, NAMESPACE)


def _out_autograd_entry(op: OpDef, namespace: str):
    """The ``Autograd`` kernel of ``namespace::<op>.out``: a refusal when a gradient is requested,
    otherwise straight on to the same overload's device kernel."""
    overload = getattr(getattr(torch.ops, namespace), op.name).out
    below_autograd = torch._C._after_autograd_keyset

    def autograd(keyset, *args, **outs):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args, *outs.values()):
            raise RuntimeError(f"{op.qualname}.out does not support autograd: it writes its outputs in place")
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & below_autograd, *args, **outs)
    return autograd


def _span(t) -> tuple:
    """The bytes ``[lo, hi)`` that hold ``t``'s elements (``(0, 0)`` when it has none)."""
    if t.numel() == 0:
        return 0, 0
    size = t.element_size()
    lo = hi = t.data_ptr()
    for n, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (n - 1) * stride * size
        else:
            lo += (n - 1) * stride * size
    return lo, hi + size


def _traced(args: tuple) -> bool:
    """Whether a tensor argument is a traced one (fake, functional, meta), which holds no data."""
    return any(isinstance(t, (FakeTensor, FunctionalTensor)) or (isinstance(t, torch.Tensor) and t.device.type == "meta")
               for t in args)


def _meets(a, b) -> bool:
    """Whether two tensors' byte ranges meet (a bound: interleaved strided views count as meeting)."""
    return _spans_meet(_span(a), _span(b))


def _spans_meet(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _apart(given: tuple, args: tuple) -> bool:
    """Whether each given output's byte range meets neither another output's nor any tensor argument's
    (inputs may share memory among themselves). A bound, not exact: a strided input interleaving an
    output sends the call to the copy, which is correct."""
    outs = [_span(t) for t in given]
    spans = outs + [_span(t) for t in args if isinstance(t, torch.Tensor)]
    return not any(_spans_meet(out, span) for i, out in enumerate(outs) for j, span in enumerate(spans) if j != i)


#: per op, the CUDA calls of its ``out`` overload served by a copy of the default overload's result
#: (outputs laid out otherwise than the kernel writes, meeting an input, or a backend without ``out``)
out_copies: dict = {}


def _cuda_out_entry(op: OpDef, slot: dispatch.OpSlot, copied, offer: bool = False):
    """The ``out`` overload's CUDA kernel: the serving backend's kernel writes the given tensors when
    it takes them (``KernelSpec.out``); else ``copied``, the default overload's result copied there.
    ``offer``: on the twin of an op the C++ entry serves, a written call's signature is offered to it,
    as the default overload's twin offers its calls."""
    validate, names, where = op.validate, op.out_names, f"{op.name}.out"
    out_copies[op.name] = 0

    def cuda_out_entry(*args, **outs):
        checks_before = check.index_checks_run()
        validate(*args)
        given = tuple(outs[n] for n in names)
        impl = slot.server(args) if _apart(given, args) else None
        if impl is not None and impl.spec.out:
            try:
                impl.fn(*args, out=given)
                if offer and check.index_checks_run() == checks_before:
                    fast_path.offer(op.name, slot.sole_server(args), args)
                return given[0] if len(given) == 1 else given
            except outputs.Restage:
                pass
            except outputs.WrongOutput as e:
                t = given[e.index]
                check.fail(where, names[e.index], f"must be {e.dtype} of shape {e.shape} on {e.device}, "
                           f"got {t.dtype} of shape {tuple(t.shape)} on {t.device}")
        out_copies[op.name] += 1
        return copied(*args, **outs)
    return cuda_out_entry


def _register_out(op: OpDef) -> None:
    LIBRARY.define(op.out_schema)
    kernel, fake, autograd = _out_entries(op)
    LIBRARY.impl(f"{op.name}.out", kernel, "CompositeExplicitAutograd")
    writes = any(k.out for k in registry.BY_OP[op.name].values())
    slot = dispatch.slot(op.name, op.data_arg)
    if TWINS is not None and fast_path.serves_out(op.name):  # as the default overload: C++ kernels, these on the twin
        TWINS.define(op.out_schema)
        entry = _cuda_out_entry(op, slot, kernel, offer=not fast_path.records(op.name)) if writes else kernel
        if fast_path.records(op.name):
            entry = _recording_cuda_entry(f"{op.name}.out", entry, slot)
        TWINS.impl(f"{op.name}.out", entry, "CUDA")
        TWINS.impl(f"{op.name}.out", _out_autograd_entry(op, fast_path.TWIN_NAMESPACE), "Autograd", with_keyset=True)
        fast_path.install_out(op.name)
    else:
        if writes:
            LIBRARY.impl(f"{op.name}.out", _cuda_out_entry(op, slot, kernel), "CUDA")
        LIBRARY.impl(f"{op.name}.out", autograd, "Autograd", with_keyset=True)
    torch.library.register_fake(f"{op.qualname}.out", fake, lib=LIBRARY)

    def rule(mode, overload, types, args, kwargs):  # compiled: the default overload's route, then the copy
        with mode:
            return kernel(*args, **kwargs)
    torch.library.register_torch_dispatch(f"{op.qualname}.out", FunctionalTensorMode, rule, lib=LIBRARY)


def _register(op: OpDef) -> None:
    LIBRARY.define(op.schema)
    reference = registry.BY_OP[op.name][Backend.TORCH].load()
    LIBRARY.impl(op.name, _reference_entry(op.validate, dispatch.reference_slot(op.name, reference, op.data_arg)),
                 "CompositeExplicitAutograd")
    slot = dispatch.slot(op.name, op.data_arg)
    if TWINS is not None and fast_path.serves(op.name):  # the C++ kernels sit on the op, these on its twin
        TWINS.define(op.schema)
        TWINS.impl(op.name, _recording_cuda_entry(op.name, _cuda_entry(op.validate, slot), slot)
                   if fast_path.records(op.name) else _offering_cuda_entry(op, slot), "CUDA")
        TWINS.impl(op.name, _autograd_entry(op, fast_path.TWIN_NAMESPACE), "Autograd", with_keyset=True)
        fast_path.install(op.name)
    else:
        LIBRARY.impl(op.name, _cuda_entry(op.validate, slot), "CUDA")
        LIBRARY.impl(op.name, _autograd_entry(op), "Autograd", with_keyset=True)
    torch.library.register_fake(op.qualname, op.fake, lib=LIBRARY)
    torch.library.register_torch_dispatch(op.qualname, FunctionalTensorMode, _compile_rule(op, reference), lib=LIBRARY)
    if op.out_schema is not None:
        _register_out(op)


for _op in ALL:
    _register(_op)
