// The C++ entry of the norm and activation ops on the CUDA dispatch key: an eager call whose signature
// (op, dtypes, width, device) the Python selection has already served with TileLang calls that compiled
// host function itself through TVM-FFI's C ABI, with no Python on the way; every other call goes on to
// the Python kernels, which select, validate and launch as before (``torch_kernels/fast_path.py``).
//
// Why: host time of one eager rmsnorm 1x4096 bf16 on the H200 was 14-20 µs through the Python kernels
// against 9-12 for F.rms_norm; 3-4 of it the dispatcher's call into Python, 6 the Python Autograd
// kernel, 1.4 validation, 1.9 allocation (docs/benchmarks/README.md, bench_overhead.py).
//
// Registered here, for rmsnorm, gemma_rmsnorm, fused_add_rmsnorm, gemma_fused_add_rmsnorm,
// silu_and_mul and gelu_tanh_and_mul (not gelu_and_mul yet: its string argument is not handled here):
//   CUDA:     a published signature -> allocate (out-of-place ops), set TVM-FFI's stream to torch's
//             current one, call the host function (the norms' one-pass or streamed one by token
//             count); anything else -> the op's twin ``deepinfer_py::<op>`` on the CUDA key (the
//             Python kernel).
//   Autograd: no gradient asked -> below autograd, as the Python kernel did; else the twin's Python
//             Autograd kernel (the op's backward formula).
// and the ops of ``deepinfer_fast_path``: publish a signature, clear them all, read the counters.
//
// A published signature carries everything the op's validation looks at except the token count, so a
// call that matches it, and passes the per-call tests below (contiguity, alignment, eps, devices), is
// one validation has already accepted.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlpack/dlpack.h>
#include <torch/library.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <dlfcn.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

enum Op : int { kRmsnorm, kGemmaRmsnorm, kFusedAdd, kGemmaFusedAdd, kSilu, kGeluTanh, kNumOps };
constexpr const char* kNames[kNumOps] = {"rmsnorm", "gemma_rmsnorm", "fused_add_rmsnorm", "gemma_fused_add_rmsnorm",
                                         "silu_and_mul", "gelu_tanh_and_mul"};

constexpr bool fused(int op) { return op == kFusedAdd || op == kGemmaFusedAdd; }
constexpr bool activation(int op) { return op >= kSilu; }

struct Entry {
  int op;
  c10::ScalarType dtype, weight_dtype;
  int64_t hidden;          // the input's last dimension
  c10::DeviceIndex device;
  int64_t streamed_from;  // token count from which `streamed` serves
  void* one_pass;         // TVM-FFI function handles (one reference each, held for the process)
  void* streamed;
};

// Readers take the current table without a lock; a publish or clear swaps in a new one and keeps the
// old alive (a reader may still hold it). A few entries per op and signature: the tables stay tiny.
std::atomic<const std::vector<Entry>*> g_table{new std::vector<Entry>()};
std::mutex g_write;
std::vector<std::unique_ptr<const std::vector<Entry>>> g_retired;
std::atomic<int64_t> g_hits{0}, g_misses{0};

// A publish or clear: `edit` changes a copy of the current table, which then replaces it.
template <typename Edit>
void edit_table(Edit edit) {
  std::lock_guard<std::mutex> lock(g_write);
  auto next = std::make_unique<std::vector<Entry>>(*g_table.load());
  edit(*next);
  g_retired.emplace_back(g_table.exchange(next.release()));
}

const Entry* find(int op, const at::Tensor& x, c10::ScalarType weight_dtype) {
  const auto* table = g_table.load(std::memory_order_acquire);
  const int64_t hidden = x.size(-1);
  for (const Entry& e : *table) {
    if (e.op == op && e.hidden == hidden && e.dtype == x.scalar_type() && e.weight_dtype == weight_dtype &&
        e.device == x.device().index()) {
      return &e;
    }
  }
  return nullptr;
}

// TVM-FFI's C functions, looked up in the process on the first publish (TileLang has loaded its runtime
// by then) rather than linked: a library that pulled libtvm_ffi.so in at torch_kernels' import made
// tvm_ffi's own import abort on the H200 host (free(): invalid pointer, 2026-11-30).
struct Ffi {
  decltype(&TVMFFIFunctionCall) call = nullptr;
  decltype(&TVMFFIEnvSetStream) set_stream = nullptr;
  decltype(&TVMFFIErrorMoveFromRaised) move_error = nullptr;
  decltype(&TVMFFIObjectIncRef) inc_ref = nullptr;
  decltype(&TVMFFIObjectDecRef) dec_ref = nullptr;
};
Ffi g_ffi;
std::once_flag g_ffi_once;

template <typename F>
void bind(F& slot, const char* name) {
  slot = reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
  TORCH_CHECK(slot != nullptr, "deepinfer_fast_path: TVM-FFI's ", name, " is not loaded in this process (import tilelang first)");
}

void bind_ffi() {
  std::call_once(g_ffi_once, [] {
    Ffi f;
    bind(f.call, "TVMFFIFunctionCall");
    bind(f.set_stream, "TVMFFIEnvSetStream");
    bind(f.move_error, "TVMFFIErrorMoveFromRaised");
    bind(f.inc_ref, "TVMFFIObjectIncRef");
    bind(f.dec_ref, "TVMFFIObjectDecRef");
    g_ffi = f;
  });
  TORCH_CHECK(g_ffi.call != nullptr, "deepinfer_fast_path: TVM-FFI's functions are not loaded in this process");
}

DLDataType dl_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16: return {kDLBfloat, 16, 1};
    case c10::ScalarType::Half: return {kDLFloat, 16, 1};
    default: return {kDLFloat, 32, 1};  // publish() accepts these three only
  }
}

// A DLTensor over a contiguous tensor viewed as (rows, width), or as a vector when rows < 0.
struct Rows {
  DLTensor t;
  int64_t shape[2];
  int64_t strides[2];
  Rows(const at::Tensor& x, int64_t rows, int64_t hidden) {
    t.data = x.data_ptr();
    t.device = {kDLCUDA, x.device().index()};
    t.dtype = dl_dtype(x.scalar_type());
    t.byte_offset = 0;
    t.shape = shape;
    t.strides = strides;
    if (rows < 0) {
      t.ndim = 1; shape[0] = hidden; strides[0] = 1;
    } else {
      t.ndim = 2; shape[0] = rows; shape[1] = hidden; strides[0] = hidden; strides[1] = 1;
    }
  }
};

TVMFFIAny tensor_arg(Rows& r) {
  TVMFFIAny a;
  a.type_index = kTVMFFIDLTensorPtr;
  a.zero_padding = 0;
  a.v_ptr = &r.t;
  return a;
}

void call(int op, void* function, TVMFFIAny* args, int32_t num_args, c10::DeviceIndex device) {
  // The compiled host code launches on TVMFFIEnvGetStream(cuda, device), which tvm_ffi's Python
  // binding sets to torch's current stream around each call; so do we (CUDA graph capture included).
  const c10::Device dev(c10::DeviceType::CUDA, device);
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev).native_handle();
  TVMFFIStreamHandle previous = nullptr;
  g_ffi.set_stream(kDLCUDA, device, stream, &previous);
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  const int rc = g_ffi.call(function, args, num_args, &result);
  g_ffi.set_stream(kDLCUDA, device, previous, nullptr);
  if (rc != 0) {
    TVMFFIObjectHandle error = nullptr;
    g_ffi.move_error(&error);
    std::string message = "unknown error";
    if (error != nullptr) {
      const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
      message = std::string(cell->kind.data, cell->kind.size) + ": " + std::string(cell->message.data, cell->message.size);
      g_ffi.dec_ref(error);
    }
    TORCH_CHECK(false, "deepinfer::", kNames[op], ": the TileLang kernel call failed: ", message);
  }
}

bool aligned(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// None for a Tensor argument (it arrives undefined): Python's validation names the argument.
bool given(const c10::IValue& v) { return v.isTensor() && v.toTensor().defined(); }

// Two contiguous tensors share no byte. An in-place op's written arguments must be apart from each other
// and from the weight; a call that is not goes on to Python, whose validation names the arguments.
bool apart(const at::Tensor& a, const at::Tensor& b) {
  const auto pa = reinterpret_cast<uintptr_t>(a.data_ptr()), pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  return pa + a.nbytes() <= pb || pb + b.nbytes() <= pa;
}

// The tests every call makes on top of the signature: what validation checks beyond it, and what the
// launchers' plain case needs (contiguous rows, 16-byte aligned starts, at least one token).
bool plain(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0) && x.is_contiguous() && w.is_contiguous() &&
         x.device() == w.device() && eps >= 0.0 && x.numel() > 0 && aligned(x) && aligned(w);
}

// The published entry for this plain call on the current device, or nullptr.
const Entry* served_by(int op, const at::Tensor& x, c10::ScalarType weight_dtype) {
  const bool here = x.device().index() == c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
  return here ? find(op, x, weight_dtype) : nullptr;
}

// The host functions' signature: three tensors (rows, then the weight or the residual rows) and eps.
void launch(int op, const Entry& e, int64_t tokens, Rows& a, Rows& b, Rows& c, double eps) {
  TVMFFIAny args[4] = {tensor_arg(a), tensor_arg(b), tensor_arg(c), {}};
  args[3].type_index = kTVMFFIFloat;
  args[3].zero_padding = 0;
  args[3].v_float64 = eps;
  call(op, tokens >= e.streamed_from ? e.streamed : e.one_pass, args, 4, e.device);
}

bool serve_norm(int op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 3);
  if (!given(args[0]) || !given(args[1])) return false;
  const at::Tensor& x = args[0].toTensor();
  const at::Tensor& w = args[1].toTensor();
  const double eps = args[2].toDouble();
  const Entry* e = plain(x, w, eps) ? served_by(op, x, w.scalar_type()) : nullptr;
  if (e == nullptr) return false;
  const int64_t tokens = x.numel() / e->hidden;
  at::Tensor out = at::empty_like(x);
  Rows rx(x, tokens, e->hidden), rw(w, -1, e->hidden), ro(out, tokens, e->hidden);
  launch(op, *e, tokens, rx, rw, ro, eps);  // rmsnorm(X, W, O, eps)
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, std::move(out));
  return true;
}

bool serve_fused(int op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 4);
  if (!given(args[0]) || !given(args[1]) || !given(args[2])) return false;
  const at::Tensor& x = args[0].toTensor();
  const at::Tensor& r = args[1].toTensor();
  const at::Tensor& w = args[2].toTensor();
  const double eps = args[3].toDouble();
  const bool residual_plain = r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() && r.is_contiguous() &&
                              r.device() == x.device() && aligned(r);
  // after plain(): x and w contiguous, so byte ranges decide overlap exactly
  const bool apart_all = plain(x, w, eps) && residual_plain && apart(x, r) && apart(x, w) && apart(r, w);
  const Entry* e = apart_all ? served_by(op, x, w.scalar_type()) : nullptr;
  if (e == nullptr) return false;
  const int64_t tokens = x.numel() / e->hidden;
  Rows rx(x, tokens, e->hidden), rr(r, tokens, e->hidden), rw(w, -1, e->hidden);
  launch(op, *e, tokens, rx, rr, rw, eps);  // fused_add_rmsnorm(X, R, W, eps), in place
  torch::jit::drop(*stack, 4);
  return true;
}

bool serve_activation(int op, torch::jit::Stack* stack) {
  if (!given(torch::jit::peek(*stack, 0, 1))) return false;
  const at::Tensor& x = torch::jit::peek(*stack, 0, 1).toTensor();
  const bool rows_plain = x.dim() >= 1 && x.is_contiguous() && x.numel() > 0 && aligned(x);
  const Entry* e = rows_plain ? served_by(op, x, x.scalar_type()) : nullptr;
  if (e == nullptr) return false;  // (a published width is even: validation accepted it)
  const int64_t width = e->hidden, tokens = x.numel() / width;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = width / 2;
  at::Tensor out = at::empty(sizes, x.options());
  Rows rx(x, tokens, width), ro(out, tokens, width / 2);
  TVMFFIAny call_args[2] = {tensor_arg(rx), tensor_arg(ro)};  // act_and_mul(X, O)
  call(op, e->one_pass, call_args, 2, e->device);
  torch::jit::drop(*stack, 1);
  torch::jit::push(*stack, std::move(out));
  return true;
}

template <int op>
const c10::OperatorHandle& twin() {
  // Looked up on first need: the twins are defined by Python after this library loads.
  static const c10::OperatorHandle handle =
      c10::Dispatcher::singleton().findSchemaOrThrow((std::string("deepinfer_py::") + kNames[op]).c_str(), "");
  return handle;
}

template <int op>
void cuda_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
  if (activation(op) ? serve_activation(op, stack) : fused(op) ? serve_fused(op, stack) : serve_norm(op, stack)) {
    g_hits.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  g_misses.fetch_add(1, std::memory_order_relaxed);
  twin<op>().redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CUDA), stack);
}

template <int op>
void autograd_kernel(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (c10::GradMode::is_enabled()) {
    for (const c10::IValue& v : torch::jit::last(*stack, handle.schema().arguments().size())) {
      if (v.isTensor() && v.toTensor().requires_grad()) {
        twin<op>().callBoxed(stack);
        return;
      }
    }
  }
  at::AutoDispatchBelowAutograd below;
  handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

int op_index(const std::string& name) {
  for (int i = 0; i < kNumOps; ++i) {
    if (name == kNames[i]) return i;
  }
  TORCH_CHECK(false, "deepinfer_fast_path::publish: argument 'op' must be a norm or activation op, got '", name, "'");
}

void publish(const std::string& name, c10::ScalarType dtype, c10::ScalarType weight_dtype, int64_t hidden,
             int64_t device, int64_t streamed_from, int64_t one_pass, int64_t streamed) {
  const int op = op_index(name);
  for (c10::ScalarType t : {dtype, weight_dtype}) {
    TORCH_CHECK(t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Half || t == c10::ScalarType::Float,
                "deepinfer_fast_path::publish: dtypes must be float16, bfloat16 or float32, got ", t);
  }
  TORCH_CHECK(hidden > 0 && one_pass != 0 && streamed != 0 && (!activation(op) || (hidden % 2 == 0 && weight_dtype == dtype)),
              "deepinfer_fast_path::publish: bad entry for ", name);
  void* handles[2] = {reinterpret_cast<void*>(one_pass), reinterpret_cast<void*>(streamed)};
  bind_ffi();
  for (void* h : handles) g_ffi.inc_ref(h);
  const Entry entry{op, dtype, weight_dtype, hidden, static_cast<c10::DeviceIndex>(device), streamed_from, handles[0],
                    handles[1]};
  edit_table([&](std::vector<Entry>& table) { table.push_back(entry); });
}

void clear() {
  edit_table([](std::vector<Entry>& table) { table.clear(); });
}

std::vector<int64_t> counters() {
  return {static_cast<int64_t>(g_table.load()->size()), g_hits.load(), g_misses.load()};
}

}  // namespace

TORCH_LIBRARY(deepinfer_fast_path, m) {
  m.def("publish(str op, ScalarType dtype, ScalarType weight_dtype, int hidden, int device, int streamed_from, "
        "int one_pass, int streamed) -> ()", &publish);
  m.def("clear() -> ()", &clear);
  m.def("counters() -> int[]", &counters);  // [signatures published, calls served, calls passed on]
}

namespace {

// Both kernels of every op of kNames, by its name there.
template <int... ops>
void register_kernels(torch::Library& m, c10::DispatchKey key, std::integer_sequence<int, ops...>) {
  if (key == c10::DispatchKey::CUDA) {
    (m.impl(kNames[ops], torch::CppFunction::makeFromBoxedFunction<&cuda_kernel<ops>>()), ...);
  } else {
    (m.impl(kNames[ops], torch::CppFunction::makeFromBoxedFunction<&autograd_kernel<ops>>()), ...);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(deepinfer, CUDA, m) {
  register_kernels(m, c10::DispatchKey::CUDA, std::make_integer_sequence<int, kNumOps>());
}

TORCH_LIBRARY_IMPL(deepinfer, Autograd, m) {
  register_kernels(m, c10::DispatchKey::Autograd, std::make_integer_sequence<int, kNumOps>());
}
