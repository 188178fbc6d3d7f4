"""The FlashInfer backend (``torch_kernels/families/*/flashinfer.py``).

Without a GPU: a fake ``flashinfer`` package (``sys.modules``) whose functions have the signatures read
from FlashInfer 0.6.0, 0.6.18.post1 and 0.7.4 (:data:`SIGNATURES`), bind every call against them and
compute with torch what FlashInfer's kernels compute (base-2 LSE, its empty-partial and top-k/top-p
readings). It checks the argument mapping (names, dtypes, views written in place, LSE conversion both
ways, int32 ids), the eligibility rules, the JIT-build announcement, and, where a real FlashInfer is
importable, that the recorded signatures are its own.

On a GPU (``@pytest.mark.gpu``, the real FlashInfer): every FlashInfer-backed op against the
reference over the shared dtypes and shapes, the dispatcher serving it, and the sampler's kept set,
distribution, determinism and CUDA-graph replay.
"""

import importlib
import inspect
import math
import re
import sys
import time
import types
from typing import Optional, Tuple, Union  # noqa: F401  (the recorded signatures name them)

import pytest
import torch

import torch_kernels
from torch_kernels import dispatch, ops, registry
from torch_kernels.families.attention import reference as ref_attention
from torch_kernels.families.rope import reference as ref_rope
from torch_kernels.families.sampling import reference as ref_sampling
from torch_kernels.families.rope import ops as rope_ops
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close, compare_outputs, mutated_args, outputs_of

from conftest import family_ops


INF, NAN = math.inf, math.nan
LOG2E = 1.0 / math.log(2.0)
HALF = [torch.float16, torch.bfloat16]

# ------------------------------------------------------------------------------------------------
# The FlashInfer functions the backend calls, as read in each release (flashinfer/<module>.py; the
# functions of get_norm_module() from csrc/norm.cu, TVM-FFI, identical in 0.6.0-0.7.4). Per function,
# release -> parameters; a release uses the entry of the latest release <= it.

SIGNATURES = {
    "norm.gen_norm_module": {"0.6.0": "()"},
    "norm.get_norm_module": {"0.6.0": "()"},
    "utils.device_support_pdl": {"0.6.0": "(device)"},
    "activation.gen_act_and_mul_module": {"0.6.0": "(act_func_name)"},
    "activation.get_act_and_mul_module": {"0.6.0": "(act_func_name)"},
    "activation.silu_and_mul": {"0.6.0": "(input, out=None, enable_pdl=None)"},
    "activation.gelu_and_mul": {"0.6.0": "(input, out=None, enable_pdl=None)"},
    "activation.gelu_tanh_and_mul": {"0.6.0": "(input, out=None, enable_pdl=None)"},
    "rope.gen_rope_module": {"0.6.0": "()"},
    "rope.get_rope_module": {"0.6.0": "()"},
    "rope.apply_rope_with_cos_sin_cache_inplace": {
        "0.6.0": "(positions, query, key, head_size, cos_sin_cache, is_neox=True)"},
    "cascade.gen_cascade_module": {"0.6.0": "()"},
    "cascade.get_cascade_module": {"0.6.0": "()"},
    "cascade.merge_state": {"0.6.0": "(v_a, s_a, v_b, s_b)"},
    "sampling.gen_sampling_module": {"0.6.0": "()"},
    "sampling.get_sampling_module": {"0.6.0": "()"},
    "sampling.top_k_renorm_probs": {"0.6.0": "(probs, top_k)", "0.7.4": "(probs, top_k, is_deterministic=False)"},
    "sampling.top_p_sampling_from_probs": {
        "0.6.0": "(probs, top_p, indices=None, deterministic=True, generator=None, check_nan=False, "
                 "seed: Optional[int] = None, offset: Optional[int] = None)",
        "0.6.4": "(probs, top_p, indices=None, deterministic=True, generator=None, check_nan=False, "
                 "seed: Optional[Union[int, torch.Tensor]] = None, offset: Optional[Union[int, torch.Tensor]] = None)",
        "0.6.18": "(probs, top_p, indices=None, deterministic=True, generator=None, check_nan=False, "
                  "seed: Optional[Union[int, torch.Tensor]] = None, offset: Optional[Union[int, torch.Tensor]] = None, "
                  "return_valid=False)"},
}
NORM_MODULE = {"rmsnorm": "(out, input, weight, eps, enable_pdl)", "gemma_rmsnorm": "(out, input, weight, eps, enable_pdl)",
               "fused_add_rmsnorm": "(input, residual, weight, eps, enable_pdl)",
               "gemma_fused_add_rmsnorm": "(input, residual, weight, eps, enable_pdl)"}
RELEASES = ["0.6.0", "0.6.18.post1", "0.7.4"]


def _release(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def _signature(params: str) -> inspect.Signature:
    scope = {"torch": torch, "Optional": Optional, "Union": Union}
    exec(f"def f{params}: pass", scope)  # noqa: S102  (our own recorded text)
    return inspect.signature(scope["f"])


def recorded(name: str, version: str) -> inspect.Signature:
    by_release = SIGNATURES[name]
    key = max((r for r in by_release if _release(r) <= _release(version)), key=_release)
    return _signature(by_release[key])


# ------------------------------------------------------------------------------------------------
# The fake FlashInfer: FlashInfer's semantics in torch, on CPU tensors.


class FakeFlashInfer:
    """``install()`` puts the fake package in ``sys.modules`` and imports the backend's modules against
    it; ``calls`` records ``(name, bound arguments)``; ``compiled`` says which JIT modules are cached."""

    def __init__(self, version: str, monkeypatch):
        self.version, self.v, self.mp = version, _release(version), monkeypatch
        self.calls, self.compiled, self.smem = [], set(), 232448  # an H200's opt-in shared memory

    def _fn(self, name: str, impl, params: Optional[str] = None):
        sig = _signature(params) if params else recorded(name, self.version)

        def fn(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # TypeError when the call does not fit this release
            bound.apply_defaults()
            self.calls.append((name, dict(bound.arguments)))
            return impl(**bound.arguments)
        fn.__signature__ = sig
        return fn

    def _jit(self, mod, x: str, module_name, module):
        """``mod``'s gen_<x>_module and get_<x>_module: building takes 10 ms and caches the module."""
        fake = self

        class Spec:
            def __init__(self, name):
                self.name = name

            @property
            def is_compiled(self):
                return self.name in fake.compiled

            def get_library_path(self):
                return f"/cache/flashinfer/{self.name}/{self.name}.so"

        def get(**kw):
            name = module_name(**kw)
            if name not in self.compiled:
                time.sleep(0.01)
                self.compiled.add(name)
            return module

        mod_name = mod.__name__.split(".")[1]
        setattr(mod, f"gen_{x}_module", self._fn(f"{mod_name}.gen_{x}_module", lambda **kw: Spec(module_name(**kw))))
        setattr(mod, f"get_{x}_module", self._fn(f"{mod_name}.get_{x}_module", get))

    def install(self):
        pkg = types.ModuleType("flashinfer")
        pkg.__version__ = self.version
        pkg.__path__ = []
        mods = {name: types.ModuleType(f"flashinfer.{name}")
                for name in ("norm", "utils", "activation", "rope", "cascade", "sampling")}
        kernels = types.SimpleNamespace(**{n: self._fn(f"norm_module.{n}", getattr(self, f"_{n}"), params)
                                           for n, params in NORM_MODULE.items()})
        self._jit(mods["norm"], "norm", lambda: "norm", kernels)
        mods["utils"].device_support_pdl = self._fn("utils.device_support_pdl", lambda device: device.type == "cuda")
        m = mods["activation"]
        self._jit(m, "act_and_mul", lambda act_func_name: f"{act_func_name}_and_mul", None)
        for act in ("silu", "gelu", "gelu_tanh"):
            setattr(m, f"{act}_and_mul", self._fn(f"activation.{act}_and_mul",
                                                  lambda input, out, enable_pdl, act=act: self._act(input, act)))
        self._jit(mods["rope"], "rope", lambda: "rope", object())
        mods["rope"].apply_rope_with_cos_sin_cache_inplace = self._fn("rope.apply_rope_with_cos_sin_cache_inplace", self._rope)
        self._jit(mods["cascade"], "cascade", lambda: "cascade", object())
        mods["cascade"].merge_state = self._fn("cascade.merge_state", self._merge_state)
        m = mods["sampling"]
        self._jit(m, "sampling", lambda: "sampling", object())
        m.top_k_renorm_probs = self._fn("sampling.top_k_renorm_probs", self._top_k_renorm)
        m.top_p_sampling_from_probs = self._fn("sampling.top_p_sampling_from_probs", self._top_p_sampling)
        self.mp.setitem(sys.modules, "flashinfer", pkg)
        for name, mod in mods.items():
            setattr(pkg, name, mod)
            self.mp.setitem(sys.modules, f"flashinfer.{name}", mod)
        # the backend's package and modules, imported afresh against the fake (restored afterwards)
        families = ("norm", "activation", "rope", "attention", "sampling")
        for f in families:
            self.mp.delattr(importlib.import_module(f"torch_kernels.families.{f}"), "flashinfer", raising=False)
        for name in [n for n in sys.modules if n.endswith(".flashinfer") and n.startswith("torch_kernels.families.")
                     or n == "torch_kernels.backends.flashinfer_jit"]:
            self.mp.delitem(sys.modules, name)
        self.mp.delattr(importlib.import_module("torch_kernels.backends"), "flashinfer_jit", raising=False)
        self.norm, self.activation, self.rope, self.attention, self.sampling = (
            importlib.import_module(f"torch_kernels.families.{f}.flashinfer") for f in families)
        self._module = importlib.import_module("torch_kernels.backends.flashinfer_jit")
        self.mp.setattr(self._module, "max_shared_bytes", lambda device: self.smem)  # CPU tensors have no device
        return self

    def names(self):
        return [name for name, _ in self.calls]

    # --- FlashInfer's kernels, in torch ---------------------------------------------------------

    @staticmethod
    def _kernel_input(t, rows=None):
        assert t.dtype in HALF and t.stride(-1) == 1 and (rows is None or t.dim() == rows), (t.dtype, t.shape)

    @staticmethod
    def _kernel_weight(weight, input):
        assert weight.dtype == input.dtype and weight.is_contiguous(), "the kernel reads the weight as the input's type"

    def _normed(self, x, weight, eps, bias):
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + bias)

    def _rmsnorm(self, out, input, weight, eps, enable_pdl, bias=0.0):
        self._kernel_input(input, 2)
        self._kernel_weight(weight, input)
        out.copy_(self._normed(input, weight, eps, bias))

    def _gemma_rmsnorm(self, **kw):
        self._rmsnorm(**kw, bias=1.0)

    def _fused_add_rmsnorm(self, input, residual, weight, eps, enable_pdl, bias=0.0):
        self._kernel_input(input, 2)
        self._kernel_input(residual, 2)
        self._kernel_weight(weight, input)
        s = input.float() + residual.float()
        residual.copy_(s)
        input.copy_(self._normed(s, weight, eps, bias))

    def _gemma_fused_add_rmsnorm(self, **kw):
        self._fused_add_rmsnorm(**kw, bias=1.0)

    def _act(self, input, act):
        assert input.dtype in HALF and input.is_contiguous()
        d = input.shape[-1] // 2
        if self.v < (0, 7, 4):
            assert d % 8 == 0, "0.6.x loads 16 bytes from the up half"
        g, u = input[..., :d].float(), input[..., d:].float()
        f = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
             "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}[act]
        return (f(g) * u).to(input.dtype)

    def _rope(self, positions, query, key, head_size, cos_sin_cache, is_neox):
        if self.v >= (0, 6, 18) and cos_sin_cache.dtype != torch.float32:
            raise ValueError("cos_sin_cache should be float32")
        assert cos_sin_cache.is_contiguous() and positions.is_contiguous() and positions.dtype in (torch.int32, torch.int64)
        q, k = query.view(query.shape[0], -1, head_size), key.view(key.shape[0], -1, head_size)  # as FlashInfer does
        self._kernel_input(q, 3)
        self._kernel_input(k, 3)
        ref_rope.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)  # vLLM's math, FlashInfer's too

    def _merge_state(self, v_a, s_a, v_b, s_b):
        """MergeStateKernel: base-2 LSE; CUDA's max() drops a NaN; 0.7 guards ``(-inf) - (-inf)``."""
        assert s_a.dtype == s_b.dtype == torch.float32 and s_a.is_contiguous() and s_b.is_contiguous()
        assert v_a.is_contiguous() and v_b.is_contiguous() and v_a.dtype in HALF
        m = torch.fmax(s_a, s_b)
        if self.v >= (0, 7, 0):
            ea, eb = torch.exp2(torch.fmax(s_a - m, torch.tensor(-INF))), torch.exp2(torch.fmax(s_b - m, torch.tensor(-INF)))
            d = ea + eb
            wa, wb = torch.where(d > 0, ea / d, 0.0), torch.where(d > 0, eb / d, 0.0)
        else:
            ea, eb = torch.exp2(s_a - m), torch.exp2(s_b - m)
            d = ea + eb
            wa, wb = ea / d, eb / d
        v = (wa[..., None] * v_a.float() + wb[..., None] * v_b.float()).to(v_a.dtype)
        return v, torch.log2(d) + m

    def _top_k_renorm(self, probs, top_k, is_deterministic=False):
        """RadixTopKRenormProb: k read as uint32 (negative: keep all), ties kept; k = 0, outside the documented
        (0, V), faked as keeping nothing."""
        assert probs.dtype == torch.float32 and probs.is_contiguous() and top_k.dtype == torch.int32
        V = probs.shape[1]
        k = top_k.long() % 2**32
        kth = probs.sort(-1, descending=True).values.gather(-1, (k.clamp(1, V) - 1)[:, None])
        kept = torch.where((k >= V)[:, None], True, (probs >= kth) & (k > 0)[:, None])
        kept_p = torch.where(kept, probs, 0.0)
        return kept_p / kept_p.sum(-1, keepdim=True).clamp(min=1e-8)

    def _top_p_sampling(self, probs, top_p, indices, deterministic, generator, check_nan, seed, offset, return_valid=False):
        """TopPSamplingFromProb: a token with p > 0 is accepted when the mass strictly above it is < top_p;
        the draw is proportional to p among the accepted (here torch's generator, keyed by seed/offset/row)."""
        assert probs.dtype == torch.float32 and probs.is_contiguous() and top_p.dtype == torch.float32
        if self.v < (0, 6, 4):
            assert isinstance(seed, int) and isinstance(offset, int)
        else:  # what _validate_and_convert_seed_offset accepts
            assert seed.dtype == offset.dtype == torch.int64 and seed.shape == offset.shape == (1,)
            seed, offset = int(seed), int(offset)
        asc = probs.sort(-1).values
        cum = asc.cumsum(-1)
        at_most = cum.gather(-1, torch.searchsorted(asc, probs, right=True) - 1)  # mass of values <= p
        above = cum[:, -1:] - at_most
        accepted = (probs > 0) & (above < top_p[:, None])
        out = torch.zeros(probs.shape[0], dtype=torch.int32)
        for row in range(probs.shape[0]):
            w = torch.where(accepted[row], probs[row], 0.0).double()
            if w.sum() > 0:
                g = torch.Generator().manual_seed((seed * 1000003 + offset * 7919 + row) % 2**63)
                out[row] = int(torch.multinomial(w, 1, generator=g))
        return out


@pytest.fixture
def fake(monkeypatch):
    """FlashInfer 0.7.4, faked."""
    return FakeFlashInfer("0.7.4", monkeypatch).install()


@pytest.fixture(params=RELEASES)
def fake_release(request, monkeypatch):
    """Each release whose signatures are recorded, faked."""
    return FakeFlashInfer(request.param, monkeypatch).install()


def _reference(op):
    return registry.BY_OP[op][Backend.TORCH].load()


# ------------------------------------------------------------------------------------------------
# Signatures and inventory.


@pytest.mark.parametrize("version", RELEASES)
def test_recorded_signatures_parse_and_differ_only_where_read(version):
    for name in SIGNATURES:
        assert isinstance(recorded(name, version), inspect.Signature), name
    seed = recorded("sampling.top_p_sampling_from_probs", version).parameters["seed"].annotation
    assert ("Tensor" in str(seed)) == (_release(version) >= (0, 6, 4))
    assert ("is_deterministic" in recorded("sampling.top_k_renorm_probs", version).parameters) == (version == "0.7.4")


def test_recorded_signatures_are_the_installed_flashinfers():
    """Where a real FlashInfer imports (the README's test command installs it without its CUDA
    dependencies; a GPU machine has it installed), its signatures are the recorded ones for its release:
    names, kinds, defaults, and whether ``seed`` takes a tensor."""
    fi = pytest.importorskip("flashinfer")
    for module in ("norm", "utils", "activation", "rope", "cascade", "sampling"):
        importlib.import_module(f"flashinfer.{module}")
    for name in SIGNATURES:
        module, fn = name.split(".")
        real = inspect.signature(inspect.unwrap(getattr(getattr(fi, module), fn)))
        want = recorded(name, fi.__version__)
        shape = lambda s: [(p.name, p.kind, p.default) for p in s.parameters.values()]  # noqa: E731
        assert shape(real) == shape(want), f"{name} in FlashInfer {fi.__version__}: {real} vs recorded {want}"
        if "seed" in want.parameters:
            assert ("Tensor" in str(real.parameters["seed"].annotation)) == ("Tensor" in str(want.parameters["seed"].annotation))


def test_inventory_lines(fake):
    specs = {k.op: k for k in registry.KERNELS if k.backend is Backend.FLASHINFER}
    # the inventory lists exactly the ops the backend's modules implement (a launcher and its check)
    modules = (fake.norm, fake.activation, fake.rope, fake.attention, fake.sampling)
    assert set(specs) == {op for m in modules for op in ops.BY_NAME if callable(getattr(m, op, None))
                          and callable(getattr(m, f"{op}_refuses", None))}
    assert all(k.target.split(":")[0] in {m.__name__ for m in modules} for k in specs.values())
    for op, k in specs.items():
        assert k.backend is Backend.FLASHINFER and k.capability.package == "flashinfer" and k.check
        assert k.dtypes == (("float32", "float16", "bfloat16") if op.startswith("top_k") else ("float16", "bfloat16")), op
        order = registry.backends_of(op)
        assert order.index(Backend.TRITON) < order.index(Backend.FLASHINFER) < order.index(Backend.TORCH), order


def test_launchers_and_checks_take_the_references_arguments(fake):
    """The reference's arguments, and a launcher that writes its out overload's tensors the keyword
    ``out`` besides (``KernelSpec.out``)."""
    for k in (k for k in registry.KERNELS if k.backend is Backend.FLASHINFER):
        ref = inspect.signature(_reference(k.op))
        strip = lambda s: [(p.name, p.default) for p in s.parameters.values()]  # noqa: E731
        assert strip(inspect.signature(k.load())) == strip(ref) + ([("out", None)] if k.out else []), k.op
        assert strip(inspect.signature(k.load_check())) == strip(ref), k.op


# ------------------------------------------------------------------------------------------------
# JIT modules: loaded once, a build announced once with its duration, traced.


def test_jit_build_announced_once_with_its_duration(fake, capfd, tmp_path):
    dispatch.configure(trace_path=str(tmp_path / "trace"))
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    for _ in range(3):
        fake.norm.rmsnorm(x, w, 1e-6)
        fake.norm.fused_add_rmsnorm(x.clone(), x.clone(), w, 1e-6)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("[deepinfer] flashinfer 0.7.4: JIT module 'norm' built on first use in ")
    seconds = float(err[0].split(" in ")[1].split(" s ")[0])
    assert seconds >= 0.0 and "/cache/flashinfer/norm/norm.so" in err[0]
    assert fake.names().count("norm.get_norm_module") == 1  # one load per process
    trace = (tmp_path / "trace").read_text().splitlines()
    assert len(trace) == 1 and trace[0].startswith("flashinfer-jit|norm|built|") and trace[0].endswith("s")


def test_jit_cached_module_is_not_announced(fake, capfd):
    fake.compiled.update({"silu_and_mul", "gelu_tanh_and_mul"})
    x = torch.randn(2, 16, dtype=torch.float16)
    fake.activation.silu_and_mul(x)
    fake.activation.gelu_and_mul(x, "tanh")
    assert capfd.readouterr().err == ""
    fake.activation.gelu_and_mul(x, "none")  # the erf module: not in the cache
    err = capfd.readouterr().err
    assert "JIT module 'gelu_and_mul' built on first use in " in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------
# Norm.


def _rows(shape, stride, dtype):
    if stride is None:
        return torch.randn(shape, dtype=dtype)
    return torch.randn(*shape[:-1], stride, dtype=dtype)[..., :shape[-1]]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("op", family_ops("norm", Backend.FLASHINFER))
def test_norm_maps_onto_the_norm_module_in_place(fake_release, op, dtype):
    fused = "fused" in op
    for shape, stride in (((7, 1000), None), ((2, 3, 256), None), ((5, 96), 160), ((1, 1), None)):
        x, r, w = _rows(shape, stride, dtype), _rows(shape, stride, dtype), torch.randn(shape[-1], dtype=dtype)
        args = (x, r, w, 1e-5) if fused else (x, w, 1e-5)
        assert getattr(fake_release.norm, f"{op}_refuses")(*args) is None
        fake_release.calls.clear()
        got = outputs_of(getattr(fake_release.norm, op), args, (0, 1) if fused else ())
        want = outputs_of(_reference(op), args, (0, 1) if fused else ())
        for g, wnt in zip(got, want):
            assert_close(g, wnt)
        name, call = fake_release.calls[-1]
        assert name == f"norm_module.{op}" and call["eps"] == 1e-5 and call["enable_pdl"] is False
        assert call["weight"] is w
        if fused:  # the rows written are views of the op's own tensors (outputs_of passes clones)
            assert call["input"].dim() == 2 and call["input"].stride(0) == (stride or shape[-1])
        else:
            assert call["out"].is_contiguous() and call["input"].data_ptr() == x.data_ptr()


def test_norm_refusals(fake):
    n = fake.norm
    x, w = torch.randn(4, 96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    assert "reads the weight as the input's type" in n.rmsnorm_refuses(x, w.float())
    assert "not 16-byte aligned" in n.rmsnorm_refuses(torch.randn(4, 97, dtype=torch.bfloat16)[:, 1:], w)
    assert "rows are not 16-byte aligned" in n.rmsnorm_refuses(torch.randn(4, 100, dtype=torch.bfloat16)[:, :96], w)
    assert n.rmsnorm_refuses(torch.randn(4, 99, dtype=torch.bfloat16)[:, :33], torch.randn(33, dtype=torch.bfloat16)) is None
    base = torch.randn(3, 4, 160, dtype=torch.bfloat16)
    assert "do not collapse" in n.fused_add_rmsnorm_refuses(base[:, 1:3, :96], base[:, 1:3, :96].clone(), w)
    fake.smem = (4 + 96) * 4 - 1  # a fused row: 4 N bytes and the warp sums, padded to 4 floats
    assert "shared memory" in n.fused_add_rmsnorm_refuses(x, x.clone(), w)
    assert n.rmsnorm_refuses(x, w) is None  # the unfused kernel keeps nothing per element
    fake.smem += 1
    assert n.fused_add_rmsnorm_refuses(x, x.clone(), w) is None


def test_norm_without_weight_takes_a_weight_of_ones(fake):
    """weight=None (rmsnorm, fused_add_rmsnorm): the kernels read a weight, so they get cached ones in
    the input's dtype, and the refusals look at those."""
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    assert fake.norm.rmsnorm_refuses(x, None) is None and fake.norm.fused_add_rmsnorm_refuses(x, x.clone(), None) is None
    assert_close(fake.norm.rmsnorm(x, None, 1e-5), _reference("rmsnorm")(x, None, 1e-5))
    fake.norm.fused_add_rmsnorm(x.clone(), x.clone(), None, 1e-5)
    weights = [call["weight"] for name, call in fake.calls if name.startswith("norm_module")]
    assert len(weights) == 2 and weights[0] is weights[1]
    assert weights[0].dtype == torch.bfloat16 and torch.equal(weights[0], torch.ones(96, dtype=torch.bfloat16))


def test_norm_zero_rows_launch_nothing(fake):
    x, w = torch.randn(0, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    assert fake.norm.rmsnorm(x, w).shape == (0, 64)
    fake.norm.fused_add_rmsnorm(x, x.clone(), w)
    assert not any(name.startswith("norm_module") for name in fake.names())


# ------------------------------------------------------------------------------------------------
# Activation.


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_activation_maps_approximate_onto_two_functions(fake_release, dtype):
    x = torch.randn(5, 2, 2 * 64, dtype=dtype) * 2
    for op, args, called in (("silu_and_mul", (x,), "silu_and_mul"), ("gelu_and_mul", (x, "none"), "gelu_and_mul"),
                             ("gelu_and_mul", (x, "tanh"), "gelu_tanh_and_mul"),
                             ("gelu_tanh_and_mul", (x,), "gelu_tanh_and_mul")):
        fake_release.calls.clear()
        out = getattr(fake_release.activation, op)(*args)
        assert_close(out, _reference(op)(*args))
        assert out.shape == (5, 2, 64) and out.is_contiguous()
        assert fake_release.names()[-1] == f"activation.{called}", (op, args[1:], fake_release.names())


def test_activation_refusals_per_release(fake_release):
    a = fake_release.activation
    assert "strided rows" in a.silu_and_mul_refuses(torch.randn(4, 160, dtype=torch.float16)[:, :128])
    odd = torch.randn(3, 2 * 3420, dtype=torch.float16)  # d = 3420 (Qwen2.5-VL): 4-element loads on 0.7.4
    misaligned = torch.randn(3 * 2 * 3420 + 2, dtype=torch.float16)[2:].view(3, 2 * 3420)
    if fake_release.v >= (0, 7, 4):
        assert a.silu_and_mul_refuses(odd) is None
        assert "not 8-byte aligned" in a.silu_and_mul_refuses(misaligned)
        assert_close(a.silu_and_mul(odd), _reference("silu_and_mul")(odd))
    else:
        assert "not a multiple of 8" in a.silu_and_mul_refuses(odd)
    assert a.silu_and_mul_refuses(torch.randn(3, 2 * 3424, dtype=torch.float16)) is None
    fake_release.calls.clear()
    out = a.gelu_and_mul(torch.randn(0, 2, 32, dtype=torch.bfloat16))
    assert out.shape == (0, 2, 16) and fake_release.calls == []  # zero rows: nothing launched


# ------------------------------------------------------------------------------------------------
# Rope.


def _rope_args(t, hq, hk, hs, rd, neox, layout, dtype=torch.bfloat16, spare_row=True, positions_dtype=torch.int64):
    args = rope_ops.make_args(t, hq, hk, hs, rd, neox, layout, "cpu", dtype, torch.float32, positions_dtype, 37)
    if spare_row:  # the same cache with a row of storage behind it
        cache = torch.cat([args[4], torch.randn(1, rd)])[:37]
        args = (*args[:4], cache, args[5])
    return args


@pytest.mark.parametrize("case", [(5, 4, 2, 128, 128, True, "2d"), (3, 8, 1, 64, 32, False, "qkv"),
                                  (2, 2, 2, 256, 64, True, "3d"), (1, 1, 1, 512, 512, False, "2d"),
                                  (4, 3, 1, 128, 64, False, "3d")], ids=str)
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64], ids=str)
def test_rope_maps_onto_apply_rope_with_cos_sin_cache_inplace(fake_release, case, positions_dtype):
    args = _rope_args(*case, positions_dtype=positions_dtype)
    assert fake_release.rope.rotary_embedding_refuses(*args) is None
    fake_release.calls.clear()
    got = outputs_of(fake_release.rope.rotary_embedding, args, (1, 2))
    assert_close(got[0], outputs_of(ref_rope.rotary_embedding, args, (1, 2))[0])
    assert_close(got[1], outputs_of(ref_rope.rotary_embedding, args, (1, 2))[1])
    (name, call), = [c for c in fake_release.calls if c[0].endswith("inplace")]
    assert call["is_neox"] is case[5] and call["head_size"] == case[3] and call["positions"] is args[0]


@pytest.mark.parametrize("layout", ["2d", "qkv", "3d"])
def test_rope_batched_positions_reach_flashinfer_as_token_rows(fake, layout):
    """vLLM's batched form (positions (B, S), rows (B, S, ...)): FlashInfer gets 1-D positions and the
    (B*S, ...) views of the caller's tensors, checked and rotated as the flat call."""
    flat = _rope_args(6, 4, 2, 128, 64, True, layout)
    bat = rope_ops.batched(flat, 2)
    assert fake.rope.rotary_embedding_refuses(*bat) is None
    fake.calls.clear()
    fake.rope.rotary_embedding(*bat)
    (name, call), = [c for c in fake.calls if c[0].endswith("inplace")]
    assert call["positions"].shape == (6,) and call["query"].shape == flat[1].shape
    assert call["query"].data_ptr() == bat[1].data_ptr() and call["key"].data_ptr() == bat[2].data_ptr()


def test_rope_refusals(fake):
    r = fake.rope
    ok = _rope_args(3, 4, 2, 128, 64, True, "2d")
    positions, q, k, hs, cache, neox = ok
    assert "no key" in r.rotary_embedding_refuses(positions, q, None, hs, cache, neox)
    assert "float32" in r.rotary_embedding_refuses(positions, q, k, hs, cache.bfloat16(), neox)
    assert "strided" in r.rotary_embedding_refuses(positions, q, k, hs, torch.randn(37, 128)[:, :64], neox)
    assert "positions are strided" in r.rotary_embedding_refuses(torch.zeros(6, dtype=torch.int64)[::2], q, k, hs, cache, neox)
    assert "head_size 80" in r.rotary_embedding_refuses(*_rope_args(3, 4, 2, 80, 80, True, "2d"))
    assert "rot_dim 24" in r.rotary_embedding_refuses(*_rope_args(3, 4, 2, 64, 24, True, "2d"))
    assert "multiple of 32" in r.rotary_embedding_refuses(*_rope_args(3, 1, 1, 512, 48, True, "2d"))
    assert "GPT-J" in r.rotary_embedding_refuses(*_rope_args(3, 4, 2, 128, 64, False, "2d", spare_row=False))
    assert r.rotary_embedding_refuses(*_rope_args(3, 4, 2, 128, 64, True, "2d", spare_row=False)) is None
    qkv = torch.randn(3, 4 + 8 * 128, dtype=torch.bfloat16)
    misaligned = (positions, qkv[:, 4:4 + 512], qkv[:, 516:772], hs, cache, neox)
    assert "query heads are not 16-byte aligned" in r.rotary_embedding_refuses(*misaligned)
    before = fake.names()
    r.rotary_embedding(*_rope_args(0, 4, 2, 128, 64, True, "2d"))
    assert fake.names() == before  # zero tokens: nothing launched


# ------------------------------------------------------------------------------------------------
# Attention: base-2 LSE both ways, the empty-partial rules restored.


def _merge_inputs(T, H, D, dtype):
    return (torch.randn(T, H, D, dtype=dtype), torch.randn(T, H) * 2 + 3,
            torch.randn(T, H, D, dtype=dtype), torch.randn(T, H) * 2 + 3)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_merge_converts_lse_to_base_2_and_back(fake_release, dtype):
    v_a, lse_a, v_b, lse_b = _merge_inputs(6, 3, 64, dtype)
    lse_a = lse_a.t().contiguous().t()  # vLLM's (H, T) layout
    v, lse = fake_release.attention.merge_attn_states(v_a, lse_a, v_b, lse_b)
    (_, call), = [c for c in fake_release.calls if c[0] == "cascade.merge_state"]
    assert call["s_a"].is_contiguous() and call["s_a"].dtype == torch.float32
    assert torch.equal(call["s_a"], lse_a * LOG2E) and torch.equal(call["s_b"], lse_b * LOG2E)
    assert call["v_a"] is v_a and call["v_b"] is v_b
    want_v, want_lse = ref_attention.merge_attn_states(v_a, lse_a, v_b, lse_b)
    assert_close(v, want_v, dtype)
    assert_close(lse, want_lse, torch.float32)
    assert v.is_contiguous() and lse.is_contiguous() and lse.dtype == torch.float32


def check_empty_partials_and_nan(merge, refuses, device):
    """tests/test_attention.py's empty-partial case at a head size FlashInfer takes: -inf and FA2's +inf
    partials give the other exactly whatever their v holds, both empty give v_a and -inf; a NaN LSE
    poisons its head (0.7's kernel would read it as empty)."""
    v_a, lse_a, v_b, lse_b = (t.to(device) for t in _merge_inputs(6, 4, 64, torch.bfloat16))
    lse_a[0, :2] = lse_b[1, 1:] = -INF
    lse_a[2, 3] = lse_b[2, 3] = -INF
    lse_a[3, 0], lse_b[3, 1] = INF, INF
    lse_a[2, 2], lse_b[2, 2] = -INF, INF
    lse_a[4, 0] = NAN
    lse_a[5, 1], lse_b[5, 1] = -INF, NAN
    v_a[0, 0], v_a[0, 1], v_b[1, 2], v_b[3, 1] = NAN, INF, NAN, -INF
    assert refuses(v_a, lse_a, v_b, lse_b) is None
    v, lse = merge(v_a, lse_a, v_b, lse_b)
    want_v, want_lse = ref_attention.merge_attn_states(v_a, lse_a, v_b, lse_b)
    special = lse_a.isinf() | lse_b.isinf() | lse_a.isnan() | lse_b.isnan()
    for got, want in ((v[special], want_v[special]), (lse[special], want_lse[special])):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert v[4, 0].isnan().all() and lse[4, 0].isnan() and not v[~special].isnan().any()
    assert_close(v[~special], want_v[~special], torch.bfloat16)
    assert_close(lse[~special], want_lse[~special], torch.float32)


def test_merge_empty_partials_and_nan_exactly_as_the_reference(fake_release):
    a = fake_release.attention
    check_empty_partials_and_nan(a.merge_attn_states, a.merge_attn_states_refuses, "cpu")


def test_merge_refusals(fake):
    a = fake.attention
    assert "head size 40" in a.merge_attn_states_refuses(*_merge_inputs(2, 2, 40, torch.float16))
    assert a.merge_attn_states_refuses(*_merge_inputs(2, 128, 64, torch.float16)) is None
    assert "129 heads of 64" in a.merge_attn_states_refuses(*_merge_inputs(2, 129, 64, torch.float16))
    assert "64 heads of 256" in a.merge_attn_states_refuses(*_merge_inputs(2, 64, 256, torch.float16))
    v_a, lse_a, v_b, lse_b = _merge_inputs(4, 2, 128, torch.float16)
    assert "strided v" in a.merge_attn_states_refuses(v_a.transpose(0, 1).contiguous().transpose(0, 1), lse_a, v_b, lse_b)
    v, lse = a.merge_attn_states(*_merge_inputs(0, 2, 128, torch.float16))
    assert v.shape == (0, 2, 128) and lse.shape == (0, 2) and "cascade.merge_state" not in fake.names()


# ------------------------------------------------------------------------------------------------
# Sampling.


def _kept(probs, top_k, top_p, slack=1e-4):
    """The reference's kept set with ``top_p`` raised by ``slack`` of the kept mass: FlashInfer decides
    the top-p boundary on fp32 sums of renormalised values, so a token within their rounding of the
    boundary may be kept there and not in the exact reference."""
    bits = ref_sampling.value_bits(probs)
    q = ref_sampling.fixed_point(bits, bits.amax(-1, keepdim=True), ref_sampling.fixed_point_bits(probs.shape[1]))
    return ref_sampling.kept_mask(bits, q, top_k, torch.where(top_p > 0, top_p + slack, top_p))[0]


def _sampling_case():
    """Rows: top-k and top-p both biting, top_k 0 / negative / beyond V / int64 past 2^32 (all: no top-k),
    top_p 1 and 0 and NaN, a row of total mass 1e-12, NaN/negative/+inf entries."""
    torch.manual_seed(0)
    V = 40
    probs = torch.softmax(torch.randn(8, V), -1)
    probs[5] *= 1e-12
    probs[6, :4] = torch.tensor([NAN, -0.5, 0.0, 1e-30])
    probs[7, 9] = INF
    top_k = torch.tensor([5, 0, -1, 41, 2**32 + 3, 7, 10, 3])
    top_p = torch.tensor([0.7, 1.0, 0.0, 0.9, NAN, 0.6, 1.5, 0.8])
    return probs, top_k, top_p


def test_sampling_maps_filters_and_seeds(fake_release):
    probs, top_k, top_p = _sampling_case()
    seed, offset = torch.tensor(1234), torch.tensor([5])
    ids = fake_release.sampling.top_k_top_p_sampling_from_probs(probs, top_k, top_p, seed, offset)
    assert ids.dtype == torch.int32 and ids.shape == (8,)
    (_, renorm), = [c for c in fake_release.calls if c[0] == "sampling.top_k_renorm_probs"]
    (_, draw), = [c for c in fake_release.calls if c[0] == "sampling.top_p_sampling_from_probs"]
    assert renorm["top_k"].dtype == torch.int32 and renorm["top_k"].tolist() == [5, 40, 40, 40, 40, 7, 10, 3]
    assert renorm.get("is_deterministic", True) is True
    p = renorm["probs"]
    assert p.is_contiguous() and not p.isnan().any() and (p >= 0).all()
    assert ((p[:7].amax(-1) >= 0.5) & (p[:7].amax(-1) < 1)).all()  # each row scaled by a power of two (+inf: FLT_MAX * 2^-126)
    assert torch.equal(p[0] / probs[0], torch.full((40,), p[0, 0] / probs[0, 0]))
    assert draw["deterministic"] is True and draw["indices"] is None
    assert draw["top_p"].tolist() == pytest.approx([0.7, 2.0, 1e-30, 0.9, 1e-30, 0.6, 2.0, 0.8])
    if fake_release.v >= (0, 6, 4):
        assert draw["seed"].shape == draw["offset"].shape == (1,)  # views of ours, read on the device
        assert draw["seed"].data_ptr() == seed.data_ptr() and draw["offset"].data_ptr() == offset.data_ptr()
    else:
        assert (draw["seed"], draw["offset"]) == (1234, 5)


def test_sampled_ids_stay_in_the_references_kept_set(fake_release):
    probs, top_k, top_p = _sampling_case()
    kept = _kept(probs, top_k, top_p)
    seen = torch.zeros_like(kept)
    for offset in range(60):
        ids = fake_release.sampling.top_k_top_p_sampling_from_probs(probs, top_k, top_p, torch.tensor(7), torch.tensor(offset))
        assert kept.gather(1, ids.long()[:, None]).all(), f"offset {offset}: {ids.tolist()} outside the kept set"
        seen.scatter_(1, ids.long()[:, None], True)
    assert seen[kept.sum(-1) > 1].sum() > kept.shape[0]  # the draws are not stuck on one token


def test_sampling_refusals(fake_release, monkeypatch):
    s = fake_release.sampling
    probs = torch.softmax(torch.randn(2, 128256), -1)
    args = (probs, torch.tensor([50, 50]), torch.tensor([0.9, 0.9]), torch.tensor(1), torch.tensor(0))
    if fake_release.v >= (0, 7, 4):  # top_k_renorm_probs(is_deterministic=True)
        assert s.top_k_top_p_sampling_from_probs_refuses(*args) is None
    else:
        assert "not reproducible" in s.top_k_top_p_sampling_from_probs_refuses(*args)
        assert s.top_k_top_p_sampling_from_probs_refuses(probs[:, :32000], *args[1:]) is None
    monkeypatch.setattr(s, "_capturing", lambda probs: True)
    small = (probs[:, :1000], *args[1:])
    if fake_release.v >= (0, 6, 4):  # seed and offset read on the device: capturable
        assert s.top_k_top_p_sampling_from_probs_refuses(*small) is None
    else:
        assert "CUDA graph" in s.top_k_top_p_sampling_from_probs_refuses(*small)


def test_sampling_zero_rows_and_one_time_notice(fake, capfd):
    s = fake.sampling
    fake.compiled.add("sampling")
    empty = s.top_k_top_p_sampling_from_probs(torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64),
                                              torch.zeros(0), torch.tensor(1), torch.tensor(0))
    assert empty.dtype == torch.int32 and empty.shape == (0,) and capfd.readouterr().err == ""
    probs, top_k, top_p = _sampling_case()
    for _ in range(2):
        s.top_k_top_p_sampling_from_probs(probs, top_k, top_p, torch.tensor(1), torch.tensor(0))
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and "FlashInfer's random stream" in err[0]


# ------------------------------------------------------------------------------------------------
# On a GPU, the real FlashInfer: every FlashInfer-backed op against the reference.


def _flashinfer_spec(op):
    spec = registry.BY_OP[op][Backend.FLASHINFER]
    why = spec.unavailable_reason(torch_kernels.Platform.detect())
    if why:
        pytest.skip(f"FlashInfer cannot run here: {why}")
    return spec


def _served(op, cases):
    """Run FlashInfer's launcher on every case it does not refuse and compare with the reference;
    returns (served, refused) counts. ``cases``: (args, dtype)."""
    spec = _flashinfer_spec(op)
    fn, refuses, opdef = spec.load(), spec.load_check(), ops.BY_NAME[op]
    mutated = mutated_args(getattr(torch.ops.deepinfer, op).default)
    served = refused = 0
    for args, dtype in cases:
        if str(args[opdef.data_arg].dtype).split(".")[-1] not in spec.dtypes or refuses(*args):
            refused += 1
            continue
        got, want = outputs_of(fn, args, mutated), outputs_of(_reference(op), args, mutated)
        compare_outputs(opdef, got, want, dtype)
        served += 1
    torch.cuda.synchronize()
    return served, refused


def _samples(op, extra=()):
    return [(args, dtype) for dtype in (torch.float32, *HALF) for args in ops.BY_NAME[op].samples("cuda", dtype)] + list(extra)


@pytest.mark.gpu
@pytest.mark.parametrize("op", family_ops("norm", Backend.FLASHINFER))
def test_gpu_norm_matches_reference(op):
    from test_norm import GPU_SHAPES, SHAPES
    fused = "fused" in op
    extra = []
    for dtype in HALF:
        for shape, stride in SHAPES + GPU_SHAPES:
            x = torch.randn(*shape[:-1], stride or shape[-1], dtype=dtype, device="cuda")[..., :shape[-1]]
            w = torch.randn(shape[-1], dtype=dtype, device="cuda")
            extra.append(((x, x.clone(), w, 1e-5) if fused else (x, w, 1e-5), dtype))
    served, refused = _served(op, _samples(op, extra))
    assert served >= 20, (served, refused)  # (4096, 8192), (33, 7168) strided, (1, 65536) ... are FlashInfer's


@pytest.mark.gpu
@pytest.mark.parametrize("op", family_ops("activation", Backend.FLASHINFER))
def test_gpu_activation_matches_reference(op):
    extra = [((torch.randn(t, 2 * d, dtype=dtype, device="cuda") * 2, *(("none",) if op == "gelu_and_mul" else ())), dtype)
             for dtype in HALF for t, d in ((37, 1536), (8192, 14336 // 4), (1, 3420), (3, 8))]
    if op == "gelu_and_mul":
        extra += [((x, "tanh"), dtype) for x, dtype in ((torch.randn(5, 256, dtype=d, device="cuda"), d) for d in HALF)]
    served, refused = _served(op, _samples(op, extra))
    assert served >= 8, (served, refused)


@pytest.mark.gpu
def test_gpu_rope_matches_reference():
    cases = [(8192, 32, 8, 128, 128, True, "qkv"), (1, 32, 8, 128, 128, True, "qkv"), (1000, 16, 2, 128, 64, False, "2d"),
             (333, 28, 4, 64, 64, True, "3d"), (7, 4, 4, 256, 128, False, "3d"), (5, 2, 1, 512, 512, True, "2d")]
    extra = []
    for dtype in HALF:
        for case in cases:
            for positions_dtype in (torch.int32, torch.int64):
                args = rope_ops.make_args(*case, device="cuda", dtype=dtype, positions_dtype=positions_dtype, max_position=4096)
                cache = torch.cat([args[4], torch.randn(1, case[4], device="cuda")])[:4096]  # a spare row: GPT-J served
                extra.append(((*args[:4], cache, args[5]), dtype))
    served, refused = _served("rotary_embedding", _samples("rotary_embedding", extra))
    assert served >= 2 * len(cases) * 2, (served, refused)


@pytest.mark.gpu
def test_gpu_merge_matches_reference():
    extra = [(tuple(t.cuda() for t in _merge_inputs(T, H, D, dtype)), dtype)
             for dtype in HALF for T, H, D in ((8192, 32, 128), (257, 32, 128), (1, 8, 64), (33, 7, 256), (3, 4, 512))]
    served, refused = _served("merge_attn_states", _samples("merge_attn_states", extra))
    assert served >= 14, (served, refused)


@pytest.mark.gpu
def test_gpu_merge_empty_partials_and_nan_exactly_as_the_reference():
    spec = _flashinfer_spec("merge_attn_states")
    check_empty_partials_and_nan(spec.load(), spec.load_check(), "cuda")


def _gpu_sampler():
    return _flashinfer_spec("top_k_top_p_sampling_from_probs").load()


@pytest.mark.gpu
def test_gpu_sampled_ids_in_the_kept_set_over_many_seeds():
    from test_sampling import _odd_values, _softmax, _ties
    sample = _gpu_sampler()
    torch.manual_seed(3)
    V = 128256
    t = lambda values: torch.tensor(values, device="cuda")  # noqa: E731
    cases = [(_softmax(64, V, "cuda"), torch.full((64,), 50, device="cuda"), torch.full((64,), 0.9, device="cuda")),
             (_softmax(8, V, "cuda", scale=1.0), t([0, 2000, 1024, 1, V, -1, 100000, 7]),
              t([0.9, 0.9, 0.5, 1.0, 0.2, 1.0, 0.95, 0.0])),
             (_ties(4, 300, "cuda"), t([10, 80, 0, 299]), t([0.5, 0.9, 0.35, 0.6])),
             (_odd_values(4, 200, "cuda"), t([3, 4, 0, 10]), t([0.9, 0.9, 0.5, 0.6])),
             (_softmax(5, 32000, "cuda", stride=32768), t([40, 0, 600, 3, 31999]), t([0.8, 0.95, 0.99, 0.1, 0.999]))]
    for probs, top_k, top_p in cases:
        kept = _kept(probs, top_k, top_p)
        for seed in range(40):
            ids = sample(probs, top_k, top_p, torch.tensor(seed, device="cuda"), torch.tensor(3 * seed, device="cuda"))
            assert ids.dtype == torch.int32
            assert kept.gather(1, ids.long()[:, None]).all(), f"seed {seed}: a token outside the kept set {ids.tolist()[:8]}"


@pytest.mark.gpu
def test_gpu_sample_distribution_chi_square():
    from conftest import chi_square_critical
    from test_sampling import _formula, _softmax
    sample = _gpu_sampler()
    torch.manual_seed(4)
    V = 40
    row = _softmax(1, V, "cuda", scale=1.0)
    top_k, top_p = torch.tensor([25], device="cuda"), torch.tensor([0.7], device="cuda")
    kept, expected, _ = _formula(row, top_k, top_p)
    n_kept = int(kept.sum())
    reps, draws = 10000, 10
    counts = torch.zeros(V, dtype=torch.float64, device="cuda")
    for offset in range(draws):
        ids = sample(row.repeat(reps, 1), top_k.repeat(reps), top_p.repeat(reps), torch.tensor(7, device="cuda"),
                     torch.tensor(offset, device="cuda"))
        counts += torch.bincount(ids.long(), minlength=V).double()
    n = reps * draws
    assert counts[~kept[0]].sum() == 0
    exp = expected[0][kept[0]] * n
    chi2 = (((counts[kept[0]] - exp) ** 2) / exp).sum().item()
    assert chi2 < chi_square_critical(n_kept - 1), f"chi-square {chi2:.1f} with {n_kept - 1} degrees of freedom"


@pytest.mark.gpu
def test_gpu_sampling_deterministic_per_seed_offset_and_graph_replay():
    from test_sampling import _softmax
    sample = _gpu_sampler()
    torch.manual_seed(6)
    probs = _softmax(64, 128256, "cuda")
    top_k, top_p = torch.full((64,), 50, device="cuda"), torch.full((64,), 0.9, device="cuda")
    seed, offset = torch.tensor(11, device="cuda"), torch.tensor(0, device="cuda")
    first = sample(probs, top_k, top_p, seed, offset)
    assert all(torch.equal(first, sample(probs, top_k, top_p, seed, offset)) for _ in range(5))
    assert torch.equal(first[:5], sample(probs[:5], top_k[:5], top_p[:5], seed, offset)), "a row's draw depends on the batch"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(probs, top_k, top_p, seed, offset)
    seen = []
    for step in (3, 4, 1000):
        offset.fill_(step)
        graph.replay()
        assert torch.equal(out, sample(probs, top_k, top_p, seed, offset))
        seen.append(out.clone())
    assert not torch.equal(seen[0], seen[1])


@pytest.mark.gpu
def test_gpu_dispatcher_serves_flashinfer_and_falls_back_loudly(tmp_path, capfd):
    for op in ("rmsnorm", "merge_attn_states"):
        _flashinfer_spec(op)
    trace = tmp_path / "trace"
    dispatch.configure(backend="flashinfer", trace_path=str(trace))
    x, w = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda"), torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    assert_close(torch.ops.deepinfer.rmsnorm(x, w, 1e-6), _reference("rmsnorm")(x, w, 1e-6))
    args = tuple(t.cuda() for t in _merge_inputs(16, 8, 128, torch.float16))
    got, want = torch.ops.deepinfer.merge_attn_states(*args), _reference("merge_attn_states")(*args)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1], torch.float32)
    capfd.readouterr()
    x32 = x.float()
    assert_close(torch.ops.deepinfer.rmsnorm(x32, w.float(), 1e-6), _reference("rmsnorm")(x32, w.float(), 1e-6))
    fallback = re.search(r"op 'rmsnorm' served by '(\w+)': 'flashinfer' refuses the call \(dtype torch.float32",
                         capfd.readouterr().err)
    assert fallback, "the fallback did not say so"
    lines = [line for line in trace.read_text().splitlines() if line.split("|")[0] in registry.OPS]  # not JIT lines
    assert lines == ["rmsnorm|flashinfer", "merge_attn_states|flashinfer", f"rmsnorm|{fallback.group(1)}"], lines
