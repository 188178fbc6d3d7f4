// The C++ entry on the CUDA and Autograd keys of the ops ``torch_kernels/fast_path.py`` installs: an eager
// call whose signature (op, dtypes of its tensors, width or shapes, device) the Python selection has already served
// with a backend's compiled host function calls that function itself through TVM-FFI's C ABI, with no
// Python on the way; every other call goes on to the op's twin ``deepinfer_py::<op>`` (the Python kernels).
//
// Why: an eager 1x4096 bf16 norm took 14-20 µs of host time through the Python kernels, 9-12 in F.rms_norm (H200).
//
// It knows no op. ``install(op, roles, output, call)`` registers the op's kernels from its manifest's
// HostCall: per schema argument a role (r rows like the data argument, w a vector of its width, f a float
// >= 0, e one whose value is part of the signature too; t a tensor of 1-3 dims whose first is the call's
// tokens and c a 2-D one of a fixed shape, both passed with their strides; o an optional one-element
// float32 tensor, passed as (1,) when given; i an int, b a bool and s a string, not passed), the output
// (none, r rows, h rows of half the width, p the schema's returns laid out as each signature publishes
// them) and the host function's argument order (-1 - k output k); the arguments the schema marks
// written are read from it.
// ``install_out(op)`` then registers the same on the op's ``out`` overload, whose last argument is the
// output. Per call:
//   CUDA:     tensors given and shaped as their roles say, on the current device (r and w contiguous and
//             16-byte aligned; t of one to three dimensions and c of two, the last of stride 1, their data
//             pointer and other strides multiples of the granule published); floats >= 0; a token at least;
//             written tensors proven apart from every other; the shapes, ints and bools of a published
//             signature (a string by its number from ``intern``, an o tensor by whether it is given)
//             -> allocate the outputs (``out``: take the given one, which must be
//             contiguous, aligned, of the output's shape and the data's dtype, on the device, and apart
//             from every argument), set TVM-FFI's stream to torch's current one, call the host function
//             published for the call's token count; else -> the twin (CUDA key).
//   Autograd: no gradient asked -> below autograd; else the twin's Python Autograd kernel.
// A published signature carries everything the op's validation looks at except the token count, so a
// call that matches it and passes the tests above is one validation has already accepted.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/DimVector.h>
#include <dlpack/dlpack.h>
#include <torch/library.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

// At most this many schema arguments (the served ops have up to 13, 16 with outputs): per-call arrays stay on the stack.
constexpr int kMaxArgs = 16;
constexpr int kMaxFacts = 3 * kMaxArgs;  // three a t tensor (its dims and sizes), two a c, one an int, bool or string
constexpr int kMaxKernels = 4;  // host functions a signature, each from a token count
constexpr int kMaxOutputs = 2;  // of an op whose outputs a signature lays out (output 'p')

// One installed op: its HostCall, resolved against its schema once.
struct OpState {
  int index;  // of the op's published entries: an out overload shares its op's
  std::string name;  // for errors
  c10::OperatorHandle twin;
  int num_args = 0, data = -1;  // the schema arguments before an out overload's output
  bool given_output = false;  // the out overload: the output is the argument after them
  bool recorded = false;  // served by recorded launches (install_recorded), not by a HostCall
  char roles[kMaxArgs] = {};
  char output = 0;  // 0 none, 'r' rows like the data argument, 'h' rows of half its width, 'p' published
  int num_outputs = 0;
  int num_facts = 0;  // of a call's signature beyond dtypes and width: shapes of t and c, ints, bools, strings
  int num_tensors = 0, tensors[kMaxArgs] = {};  // the tensor arguments, in schema order (the entries' dtypes)
  int num_written = 0, written[kMaxArgs] = {};  // the arguments the schema marks written
  int num_call = 0, call[kMaxArgs + kMaxOutputs] = {};  // the host function's arguments; -1 - k output k
  OpState(int index, std::string name, c10::OperatorHandle twin) : index(index), name(std::move(name)), twin(std::move(twin)) {}
};

struct Entry {
  int op;
  int64_t hidden;  // the data argument's last dimension (r), 0 (t: the facts hold the shapes)
  c10::DeviceIndex device;
  c10::ScalarType dtypes[kMaxArgs];  // of the tensor arguments, in schema order
  int64_t facts[kMaxFacts];  // OpState::num_facts of them
  int64_t granule[kMaxArgs];  // per schema argument: what a t or c tensor's pointer and strides are multiples of
  int num_kernels;
  int64_t max_tokens;  // the most a call may have (0: no limit)
  int64_t from[kMaxKernels];  // ascending, from[0] == 0: kernel k serves from[k] tokens up to from[k + 1]
  void* kernel[kMaxKernels];  // TVM-FFI function handles (one reference each, held for the process)
  // output 'p': each output's layout (OutputLayout), dtype and last dimension
  int8_t out_layout[kMaxOutputs];
  c10::ScalarType out_dtype[kMaxOutputs];
  int64_t out_width[kMaxOutputs];
};

// How a published output is laid out, over the data argument's leading dims `lead` (T tokens in all), and
// how the host function takes it.
enum OutputLayout : int8_t {
  kRows = 0,    // (*lead, width) contiguous; passed as (T, width)
  kToken = 1,   // (*lead, 1) contiguous; passed as (T,)
  kOne = 2,     // (1,); passed so
  kColumn = 3,  // (*lead, width) over storage (width, *lead); passed as (T, width) of strides (1, T)
  kLike = 4,    // the shape of the argument `width` (a t tensor), contiguous; passed so
};

// Readers take the current table without a lock; a publish or clear swaps in a new one and keeps the
// old alive (a reader may still hold it). A few entries per op and signature: the tables stay tiny.
std::atomic<const std::vector<Entry>*> g_table{new std::vector<Entry>()};
std::mutex g_write;
std::vector<std::unique_ptr<const std::vector<Entry>>> g_retired;
std::atomic<int64_t> g_hits{0}, g_misses{0};

// The strings of published signatures, each fact the string's index: read without a lock as the table is,
// appended to by intern() (a few: an activation's "none" and "tanh").
std::atomic<const std::vector<std::string>*> g_strings{new std::vector<std::string>()};
std::vector<std::unique_ptr<const std::vector<std::string>>> g_retired_strings;

// -1 for a string no published signature holds (such a call is passed on)
int64_t string_fact(std::string_view value) {
  const auto* strings = g_strings.load(std::memory_order_acquire);
  for (size_t k = 0; k < strings->size(); ++k) {
    if ((*strings)[k] == value) return static_cast<int64_t>(k);
  }
  return -1;
}

int64_t intern(const std::string& value);

// The installed ops (each kernel holds its own's address) and the two libraries holding their kernels.
std::mutex g_install;
std::vector<std::unique_ptr<OpState>> g_ops;
std::unique_ptr<torch::Library> g_cuda_library, g_autograd_library;

// A publish or clear: `edit` changes a copy of the current table, which then replaces it.
// `edit` changes a copy of `current`'s list, which then replaces it; the old one is kept alive for readers
// still holding it. Under g_write.
template <typename T, typename Edit>
void swap_in(std::atomic<const std::vector<T>*>& current, std::vector<std::unique_ptr<const std::vector<T>>>& retired,
             Edit edit) {
  auto next = std::make_unique<std::vector<T>>(*current.load());
  edit(*next);
  retired.emplace_back(current.exchange(next.release()));
}

template <typename Edit>
void edit_table(Edit edit) {
  std::lock_guard<std::mutex> lock(g_write);
  swap_in(g_table, g_retired, edit);
}

const Entry* find(const OpState& s, const at::Tensor* const* t, int64_t hidden, c10::DeviceIndex device,
                  const int64_t* facts) {
  c10::ScalarType dtypes[kMaxArgs];
  for (int k = 0; k < s.num_tensors; ++k) dtypes[k] = t[s.tensors[k]]->scalar_type();
  const auto* table = g_table.load(std::memory_order_acquire);
  for (const Entry& e : *table) {
    if (e.op != s.index || e.hidden != hidden || e.device != device) continue;
    int k = 0;
    while (k < s.num_tensors && e.dtypes[k] == dtypes[k]) ++k;
    int f = 0;
    while (f < s.num_facts && e.facts[f] == facts[f]) ++f;
    if (k == s.num_tensors && f == s.num_facts) return &e;
  }
  return nullptr;
}

// TVM-FFI's C functions, looked up in the process on the first publish (TileLang has loaded its runtime
// by then) rather than linked: a library that pulled libtvm_ffi.so in at torch_kernels' import made
// tvm_ffi's own import abort on the H200 host (free(): invalid pointer).
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
    case c10::ScalarType::Int: return {kDLInt, 32, 1};
    case c10::ScalarType::Long: return {kDLInt, 64, 1};
    case c10::ScalarType::Float8_e4m3fn: return {kDLFloat8_e4m3fn, 8, 1};
    default: return {kDLFloat, 32, 1};  // publish() accepts these six only
  }
}

// A DLTensor over a contiguous tensor viewed as (rows, width), or as a vector when rows < 0.
struct Rows {
  DLTensor t;
  int64_t shape[3];
  int64_t strides[3];
  void view(const at::Tensor& x, int64_t rows, int64_t width) {
    t.data = x.data_ptr();
    t.device = {kDLCUDA, x.device().index()};
    t.dtype = dl_dtype(x.scalar_type());
    t.byte_offset = 0;
    t.shape = shape;
    t.strides = strides;
    if (rows < 0) {
      t.ndim = 1; shape[0] = width; strides[0] = 1;
    } else {
      t.ndim = 2; shape[0] = rows; shape[1] = width; strides[0] = width; strides[1] = 1;
    }
  }
  // a t or c tensor as it is (one to three dimensions)
  void as_is(const at::Tensor& x) {
    view(x, -1, 1);
    t.ndim = static_cast<int32_t>(x.dim());
    for (int d = 0; d < t.ndim; ++d) {
      shape[d] = x.size(d);
      strides[d] = x.stride(d);
    }
  }
  // a published output as its layout says the host function takes it
  void output(const at::Tensor& x, OutputLayout layout, int64_t tokens, int64_t width) {
    if (layout == kLike) {
      as_is(x);
      return;
    }
    if (layout == kToken || layout == kOne) {
      view(x, -1, layout == kToken ? tokens : 1);
      return;
    }
    view(x, tokens, width);
    if (layout == kColumn) {
      strides[0] = 1;
      strides[1] = tokens;
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

TVMFFIAny float_arg(double v) {
  TVMFFIAny a;
  a.type_index = kTVMFFIFloat;
  a.zero_padding = 0;
  a.v_float64 = v;
  return a;
}

void call(const OpState& s, void* function, TVMFFIAny* args, int32_t num_args, c10::DeviceIndex device) {
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
    TORCH_CHECK(false, "deepinfer::", s.name, ": the compiled kernel call failed: ", message);
  }
}

bool aligned(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// None for a Tensor argument (it arrives undefined): Python's validation names the argument.
bool given(const c10::IValue& v) { return v.isTensor() && v.toTensor().defined(); }

// The bytes a tensor of one to three dimensions (the last of stride 1) covers: `rows` runs of `run` bytes,
// `stride` bytes apart (one run for a contiguous tensor).
struct Span {
  int64_t start, run, rows, stride;
};

Span span_of(const at::Tensor& a) {
  const int64_t isz = a.element_size(), start = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.data_ptr()));
  if (a.is_contiguous()) return {start, static_cast<int64_t>(a.nbytes()), 1, 0};
  if (a.dim() == 1) return {start, isz, a.size(0), a.stride(0) * isz};
  if (a.dim() == 2) return {start, a.size(1) * isz, a.size(0), a.stride(0) * isz};
  if (a.size(1) <= 1 || a.stride(1) == a.size(2)) return {start, a.size(1) * a.size(2) * isz, a.size(0), a.stride(0) * isz};
  // other 3-D layouts: their whole extent, marked as rows that meet (never written, apart only by extent)
  int64_t extent = isz;
  for (int d = 0; d < 3; ++d) extent += (a.size(d) - 1) * a.stride(d) * isz;
  return {start, extent, 2, 0};
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// Whether two spans share no byte, proven: their extents apart, or rows of one stride whose runs
// interleave without meeting (column slices of one buffer, as q and k of a fused qkv). Not proven ->
// the call goes on to Python, whose validation decides exactly and names the arguments.
bool apart(const Span& a, const Span& b) {
  if (a.run == 0 || b.run == 0 || a.rows == 0 || b.rows == 0) return true;
  const int64_t a_end = a.start + (a.rows - 1) * a.stride + a.run, b_end = b.start + (b.rows - 1) * b.stride + b.run;
  if (a_end <= b.start || b_end <= a.start) return true;
  const int64_t stride = a.rows > 1 ? a.stride : b.stride;
  if ((a.rows > 1 && (a.stride != stride || a.run > stride)) || (b.rows > 1 && (b.stride != stride || b.run > stride)) ||
      stride <= 0) {
    return false;
  }
  // row i of a meets row j of b iff m = i - j has d - a.run < m * stride < d + b.run
  const int64_t d = b.start - a.start;
  const int64_t lo = std::max(floor_div(d - a.run, stride) + 1, 1 - b.rows);
  const int64_t hi = std::min(-floor_div(-(d + b.run), stride) - 1, a.rows - 1);
  return lo > hi;
}

// A written t tensor whose rows are at least as far apart as they are long (no byte written twice).
bool rows_apart(const Span& a) { return a.rows <= 1 || a.stride >= a.run; }

// A t or c tensor's data pointer and strides (of dimensions above size 1, the last aside) are multiples
// of `granule` elements.
bool on_granule(const at::Tensor& a, int64_t granule) {
  if (granule <= 1) return true;
  if ((reinterpret_cast<uintptr_t>(a.data_ptr()) / a.element_size()) % granule != 0) return false;
  for (int64_t d = 0; d + 1 < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) % granule != 0) return false;
  }
  return true;
}

// Serves the call on `stack` when it is plain and its signature published; false (the stack untouched)
// otherwise. Plain: what validation checks beyond the signature, and what the launchers' plain case
// needs (contiguous, 16-byte aligned starts, at least one token).
bool serve(const OpState& s, torch::jit::Stack* stack) {
  const auto args = torch::jit::last(*stack, s.num_args + (s.given_output ? 1 : 0));
  const at::Tensor* t[kMaxArgs];
  for (int k = 0; k < s.num_tensors; ++k) {
    const c10::IValue& v = args[s.tensors[k]];
    if (!given(v)) return false;
    t[s.tensors[k]] = &v.toTensor();
  }
  const at::Tensor& x = *t[s.data];
  if (x.dim() < 1 || x.numel() == 0) return false;
  const bool rows = s.roles[s.data] == 'r';
  const int64_t hidden = rows ? x.size(-1) : 0;
  const int64_t tokens = rows ? x.numel() / hidden : x.size(0);
  const c10::Device device = x.device();
  int64_t facts[kMaxFacts];
  int num_facts = 0;
  for (int i = 0; i < s.num_args; ++i) {
    const char role = s.roles[i];
    if (role == 'f' || role == 'e') {
      if (!(args[i].isDouble() && args[i].toDouble() >= 0.0)) return false;
      if (role == 'e') facts[num_facts++] = std::bit_cast<int64_t>(args[i].toDouble());
      continue;
    }
    if (role == 'i' || role == 'b') {
      if (role == 'i' ? !args[i].isInt() : !args[i].isBool()) return false;
      facts[num_facts++] = role == 'i' ? args[i].toInt() : args[i].toBool();
      continue;
    }
    if (role == 's') {
      if (!args[i].isString()) return false;
      facts[num_facts] = string_fact(args[i].toStringView());
      if (facts[num_facts++] < 0) return false;
      continue;
    }
    if (role == 'o') {
      const bool present = given(args[i]);
      facts[num_facts++] = present;
      if (!present) continue;
      const at::Tensor& o = args[i].toTensor();
      if (o.device() != device || o.scalar_type() != c10::ScalarType::Float || o.dim() > 1 || o.numel() != 1) return false;
      continue;
    }
    const at::Tensor& a = *t[i];
    if (a.device() != device) return false;
    if (role == 't' || role == 'c') {
      if (a.dim() < 1 || a.dim() > (role == 't' ? 3 : 2) || (a.dim() >= 2 && a.stride(-1) != 1) ||
          (role == 't' ? a.size(0) != tokens : a.dim() != 2)) {
        return false;
      }
      if (role == 't') {
        facts[num_facts++] = a.dim();
        facts[num_facts++] = a.dim() >= 2 ? a.size(1) : 0;
        facts[num_facts++] = a.dim() == 3 ? a.size(2) : 0;
      } else {
        facts[num_facts++] = a.size(0);
        facts[num_facts++] = a.size(1);
      }
      continue;
    }
    const bool shaped = role == 'w' ? a.dim() == 1 && a.size(0) == hidden : i == s.data || a.sizes() == x.sizes();
    if (!shaped || !a.is_contiguous() || !aligned(a)) return false;
  }
  // each written tensor apart from itself (rows) and from every other tensor argument given (o ones too)
  for (int w = 0; w < s.num_written; ++w) {
    const Span written = span_of(*t[s.written[w]]);
    if (!rows_apart(written)) return false;
    for (int i = 0; i < s.num_args; ++i) {
      const char r = s.roles[i];
      const bool tensor = r == 'o' ? given(args[i]) : r == 'r' || r == 'w' || r == 't' || r == 'c';
      if (tensor && i != s.written[w] && !apart(written, span_of(args[i].toTensor()))) return false;
    }
  }
  if (device.index() != c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index()) return false;
  const Entry* e = find(s, t, hidden, device.index(), facts);
  if (e == nullptr || (e->max_tokens > 0 && tokens > e->max_tokens)) return false;
  for (int k = 0; k < s.num_tensors; ++k) {
    if (!on_granule(*t[s.tensors[k]], e->granule[s.tensors[k]])) return false;
  }

  at::Tensor out, outs[kMaxOutputs];
  const int64_t out_width = s.output == 'h' ? hidden / 2 : hidden;  // a published width is even
  if (s.given_output) {
    const c10::IValue& v = args[s.num_args];
    if (!given(v)) return false;
    out = v.toTensor();
    c10::DimVector sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = out_width;
    if (out.sizes() != c10::IntArrayRef(sizes) || out.scalar_type() != x.scalar_type() || out.device() != device ||
        !out.is_contiguous() || !aligned(out)) {
      return false;
    }
    const Span given_out = span_of(out);
    for (int k = 0; k < s.num_tensors; ++k) {
      if (!apart(given_out, span_of(*t[s.tensors[k]]))) return false;
    }
  } else if (s.output == 'r') {
    out = at::empty_like(x);
  } else if (s.output == 'h') {
    c10::DimVector sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = out_width;
    out = at::empty(sizes, x.options());
  } else if (s.output == 'p') {
    for (int o = 0; o < s.num_outputs; ++o) {
      const auto options = x.options().dtype(e->out_dtype[o]);
      const int64_t width = e->out_width[o];
      c10::DimVector sizes(x.sizes().begin(), x.sizes().end() - 1);
      if (e->out_layout[o] == kLike) {
        outs[o] = at::empty(t[width]->sizes(), options);
      } else if (e->out_layout[o] == kOne) {
        outs[o] = at::empty({1}, options);
      } else if (e->out_layout[o] == kColumn) {
        sizes.insert(sizes.begin(), width);
        outs[o] = at::empty(sizes, options).movedim(0, -1);
      } else {
        sizes.push_back(e->out_layout[o] == kToken ? 1 : width);
        outs[o] = at::empty(sizes, options);
      }
    }
  }
  Rows views[kMaxArgs + kMaxOutputs];
  TVMFFIAny call_args[kMaxArgs + kMaxOutputs];
  int num_call = 0;
  for (int k = 0; k < s.num_call; ++k) {
    const int i = s.call[k];
    if (i < 0 && s.output == 'p') {
      const int o = -1 - i;
      views[num_call].output(outs[o], static_cast<OutputLayout>(e->out_layout[o]), tokens, e->out_width[o]);
    } else if (i < 0) {
      views[num_call].view(out, tokens, out_width);
    } else if (s.roles[i] == 'o') {
      if (!given(args[i])) continue;  // left out of the host function's arguments
      views[num_call].view(args[i].toTensor(), -1, 1);
    } else if (s.roles[i] == 'f' || s.roles[i] == 'e') {
      call_args[num_call++] = float_arg(args[i].toDouble());
      continue;
    } else if (s.roles[i] == 't' || s.roles[i] == 'c') {
      views[num_call].as_is(*t[i]);
    } else {
      views[num_call].view(*t[i], s.roles[i] == 'w' ? -1 : tokens, hidden);
    }
    call_args[num_call] = tensor_arg(views[num_call]);
    ++num_call;
  }
  int k = e->num_kernels - 1;
  while (tokens < e->from[k]) --k;
  call(s, e->kernel[k], call_args, num_call, e->device);
  torch::jit::drop(*stack, s.num_args + (s.given_output ? 1 : 0));
  if (s.output == 'p') {
    for (int o = 0; o < s.num_outputs; ++o) torch::jit::push(*stack, std::move(outs[o]));
  } else if (s.output != 0) {
    torch::jit::push(*stack, std::move(out));
  }
  return true;
}


// ---- Recorded launches: the ops without a host function ----
//
// The first calls of such an op go to its twin, which runs the Python kernels under a recorder: when all
// they did was allocate tensors and launch Triton kernels, the twin publishes that (``record``) under the
// call's signature as the entry read it (``signature_of``: every argument's type, dtype, shape, strides,
// device, 16-byte alignment and value), and a later call of that signature allocates the same and launches
// the same kernels with the parameters recorded, each pointer moved to the same offset in the argument or
// allocation it pointed into.

// One kernel launch as recorded: the CUfunction, its geometry and one 8-byte slot per kernel parameter.
struct Launch {
  void* function;
  unsigned grid[3], block, shared;
  std::vector<int64_t> slots;
  std::vector<std::array<int64_t, 3>> patches;  // (slot, source, byte offset): source i >= 0 argument i, -1 - k allocation k
};

struct Allocation {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
  int64_t scratch_offset = -1;  // bytes into the call's scratch buffer; -1: a tensor of its own (a return views it)
};

struct Return {
  int64_t source;  // -1 - k: a view of allocation k; i >= 0: argument i as it is
  std::vector<int64_t> sizes, strides;
  int64_t offset;  // elements from the allocation's start
};

struct Recording {
  int op;
  c10::DeviceIndex device;
  std::vector<int64_t> key;
  std::vector<Allocation> allocations;
  std::vector<Return> returns;
  std::vector<Launch> launches;
  int64_t scratch_bytes = 0;  // one buffer for the allocations no return views (10 of 11 in a top-p renorm)
};

// Scratch allocations start this far apart in the buffer: the alignment Triton specialised their pointers on
// (16 bytes) and more.
constexpr int64_t kScratchAlign = 256;

// At most this many signatures an op (a decode loop's batch sizes); further calls stay with Python.
constexpr int kMaxRecordings = 64;

std::atomic<const std::vector<Recording>*> g_recordings{new std::vector<Recording>()};
std::vector<std::unique_ptr<const std::vector<Recording>>> g_retired_recordings;

using Key = c10::SmallVector<int64_t, 128>;  // a 13-argument op of 4-D tensors: ~100 words

// The call's signature: per argument a tag and what a recorded call depends on (0 None; 1 a tensor: dtype,
// device type and index, 16-byte aligned, dims, sizes, strides; 2 int, 3 float bits, 4 bool, 5 string number:
// the value; 6 int list: length, values). False: an argument of a type the entry does not read (the call
// stays with Python), or a string no signature holds unless `intern_strings`.
bool signature_of(c10::ArrayRef<c10::IValue> args, bool intern_strings, Key& key);

// The calls of recorded ops passed on to their twins on this thread, innermost last: ``pending`` hands
// the twin its call's signature.
thread_local std::vector<std::pair<const OpState*, Key>> t_pending;

struct Pending {
  Pending(const OpState* s, Key&& key) { t_pending.emplace_back(s, std::move(key)); }
  ~Pending() { t_pending.pop_back(); }
};

using LaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**);
using FuncGetParamInfo = int (*)(void*, size_t, size_t*, size_t*);
LaunchKernel g_launch = nullptr;
FuncGetParamInfo g_param_info = nullptr;  // CUDA 12.4 drivers on: checks a recording's parameters
std::once_flag g_driver_once;

void bind_driver() {
  std::call_once(g_driver_once, [] {
    // loaded by then: Triton launched the kernels being recorded through it
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda == nullptr) return;
    g_param_info = reinterpret_cast<FuncGetParamInfo>(dlsym(cuda, "cuFuncGetParamInfo"));
    g_launch = reinterpret_cast<LaunchKernel>(dlsym(cuda, "cuLaunchKernel"));
  });
  TORCH_CHECK(g_launch != nullptr, "deepinfer_fast_path::record: the CUDA driver (libcuda.so.1) is not loaded in this process");
}

bool signature_of(c10::ArrayRef<c10::IValue> args, bool intern_strings, Key& key) {
  for (const c10::IValue& v : args) {
    if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
      key.push_back(0);
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      key.append({1, static_cast<int64_t>(t.scalar_type()), static_cast<int64_t>(t.device().type()), t.device().index(),
                  aligned(t), t.dim()});
      key.append(t.sizes().begin(), t.sizes().end());
      key.append(t.strides().begin(), t.strides().end());
    } else if (v.isInt()) {
      key.append({2, v.toInt()});
    } else if (v.isDouble()) {
      key.append({3, std::bit_cast<int64_t>(v.toDouble())});
    } else if (v.isBool()) {
      key.append({4, v.toBool()});
    } else if (v.isString()) {
      const int64_t fact = intern_strings ? intern(std::string(v.toStringView())) : string_fact(v.toStringView());
      if (fact < 0) return false;
      key.append({5, fact});
    } else if (v.isIntList()) {
      const auto list = v.toIntVector();
      key.append({6, static_cast<int64_t>(list.size())});
      key.append(list.begin(), list.end());
    } else {
      return false;
    }
  }
  return true;
}

// Bytes from a strided layout's first element to just past its last (0 when it holds none); nullopt for a
// negative size or stride.
std::optional<int64_t> layout_bytes(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t element_size) {
  int64_t last = 0;
  bool empty = false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0 || strides[d] < 0) return std::nullopt;
    empty = empty || sizes[d] == 0;
    last += (sizes[d] - 1) * strides[d];
  }
  return empty ? 0 : (last + 1) * element_size;
}

// The bytes a tensor covers, for apart(): span_of's where it reads the layout, else its whole extent (never
// apart from what lies inside it). Negative strides: nullopt (not proven apart).
std::optional<Span> extent_of(const at::Tensor& a) {
  if (a.is_contiguous() || (a.dim() >= 1 && a.dim() <= 3 && a.stride(-1) == 1)) return span_of(a);
  const auto bytes = layout_bytes(a.sizes(), a.strides(), a.element_size());
  if (!bytes) return std::nullopt;
  return Span{static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.data_ptr())), *bytes, 2, 0};
}

const Recording* find_recording(const OpState& s, const Key& key) {
  for (const Recording& r : *g_recordings.load(std::memory_order_acquire)) {
    if (r.op == s.index && r.key.size() == key.size() && std::equal(key.begin(), key.end(), r.key.begin())) return &r;
  }
  return nullptr;
}

// Replays the recording of the call on `stack` when there is one and the call is plain: every CUDA tensor
// on the current device, each written argument proven apart from every other tensor argument.
bool replay(const OpState& s, torch::jit::Stack* stack, const Key& key) {
  const auto args = torch::jit::last(*stack, s.num_args);
  const Recording* r = find_recording(s, key);
  if (r == nullptr) return false;
  if (r->device != c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index()) return false;
  for (int w = 0; w < s.num_written; ++w) {
    if (!given(args[s.written[w]])) continue;
    const auto written = extent_of(args[s.written[w]].toTensor());
    if (!written) return false;
    for (int i = 0; i < s.num_args; ++i) {
      if (i == s.written[w] || !given(args[i])) continue;
      const auto other = extent_of(args[i].toTensor());
      if (!other || !apart(*written, *other)) return false;
    }
  }
  const at::TensorOptions on_device = at::TensorOptions().device(c10::DeviceType::CUDA, r->device);
  // an allocation per return's source, one buffer for the others: an at::empty costs about as much as a launch
  const at::Tensor scratch = r->scratch_bytes > 0 ? at::empty({r->scratch_bytes}, on_device.dtype(at::kByte)) : at::Tensor();
  c10::SmallVector<at::Tensor, 4> allocated;
  for (const Allocation& a : r->allocations) {
    allocated.push_back(a.scratch_offset < 0 ? at::empty_strided(a.sizes, a.strides, on_device.dtype(a.dtype)) : at::Tensor());
  }
  const auto base = [&](int64_t source) {
    if (source >= 0) return reinterpret_cast<int64_t>(args[source].toTensor().data_ptr());
    const Allocation& a = r->allocations[-1 - source];
    return a.scratch_offset < 0 ? reinterpret_cast<int64_t>(allocated[-1 - source].data_ptr())
                                : reinterpret_cast<int64_t>(scratch.data_ptr()) + a.scratch_offset;
  };
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(c10::Device(c10::DeviceType::CUDA, r->device)).native_handle();
  for (const Launch& l : r->launches) {
    if (l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0) continue;  // as Triton's launcher: an empty grid is no launch
    c10::SmallVector<int64_t, 32> slots(l.slots.begin(), l.slots.end());
    for (const auto& [slot, source, offset] : l.patches) slots[slot] = base(source) + offset;
    c10::SmallVector<void*, 32> params;
    for (int64_t& slot : slots) params.push_back(&slot);
    const int rc = g_launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1, l.shared, stream, params.data(), nullptr);
    TORCH_CHECK(rc == 0, "deepinfer::", s.name, ": launching a recorded kernel failed (CUDA driver error ", rc, ")");
  }
  c10::SmallVector<at::Tensor, 2> returns;
  for (const Return& ret : r->returns) {
    returns.push_back(ret.source >= 0 ? args[ret.source].toTensor()
                                      : allocated[-1 - ret.source].as_strided(ret.sizes, ret.strides, ret.offset));
  }
  torch::jit::drop(*stack, s.num_args);
  for (at::Tensor& t : returns) torch::jit::push(*stack, std::move(t));
  return true;
}

struct CudaKernel final : c10::OperatorKernel {
  explicit CudaKernel(const OpState* s) : s(s) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    if (s->recorded) {
      Key key;
      const bool read = signature_of(torch::jit::last(*stack, s->num_args), false, key);
      if (read && replay(*s, stack, key)) {
        g_hits.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      g_misses.fetch_add(1, std::memory_order_relaxed);
      if (!read) {  // a string no signature holds yet (interned now, for the recording), or an unread type
        key.clear();
        if (!signature_of(torch::jit::last(*stack, s->num_args), true, key)) key.clear();
      }
      Pending pending(s, std::move(key));  // an empty signature: not to be recorded
      s->twin.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CUDA), stack);
      return;
    }
    if (serve(*s, stack)) {
      g_hits.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    g_misses.fetch_add(1, std::memory_order_relaxed);
    s->twin.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CUDA), stack);
  }
  const OpState* s;
};

struct AutogradKernel final : c10::OperatorKernel {
  explicit AutogradKernel(const OpState* s) : s(s) {}
  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    if (c10::GradMode::is_enabled()) {
      for (const c10::IValue& v : torch::jit::last(*stack, s->num_args + (s->given_output ? 1 : 0))) {
        if (v.isTensor() && v.toTensor().requires_grad()) {
          s->twin.callBoxed(stack);
          return;
        }
      }
    }
    at::AutoDispatchBelowAutograd below;
    handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  const OpState* s;
};

// Keeps `state` for the process and registers its op's CUDA and Autograd kernels (`name`: op or op.overload).
// Under g_install.
void register_kernels(const std::string& name, std::unique_ptr<OpState> state) {
  if (!g_cuda_library) {
    g_cuda_library = std::make_unique<torch::Library>(torch::Library::IMPL, "deepinfer", c10::DispatchKey::CUDA, __FILE__, __LINE__);
    g_autograd_library = std::make_unique<torch::Library>(torch::Library::IMPL, "deepinfer", c10::DispatchKey::Autograd, __FILE__, __LINE__);
  }
  const OpState* held = state.get();
  g_ops.push_back(std::move(state));
  g_cuda_library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CudaKernel>(held)));
  g_autograd_library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradKernel>(held)));
}

c10::OperatorHandle defined(const std::string& qualname, const std::string& overload = "") {
  auto handle = c10::Dispatcher::singleton().findSchema({qualname, overload});
  TORCH_CHECK(handle.has_value(), "deepinfer_fast_path::install: ", qualname, " is not defined (define the op and its twin first)");
  return *handle;
}

// Registers `op`'s CUDA and Autograd kernels, as its HostCall says: `roles` one letter per schema
// argument, `output` "" "r" "h" or "p", `call` the host function's arguments (-1 - k output k).
void install(const std::string& name, const std::string& roles, const std::string& output, const std::vector<int64_t>& call) {
  std::lock_guard<std::mutex> lock(g_install);
  const std::string where = "deepinfer_fast_path::install(" + name + "): ";
  for (const auto& s : g_ops) TORCH_CHECK(s->name != name, where, "installed already");
  const c10::OperatorHandle op = defined("deepinfer::" + name);
  auto state = std::make_unique<OpState>(static_cast<int>(g_ops.size()), name, defined("deepinfer_py::" + name));
  const auto& arguments = op.schema().arguments();
  const auto& returns = op.schema().returns();
  TORCH_CHECK(roles.size() == arguments.size() && roles.size() <= static_cast<size_t>(kMaxArgs), where,
              "argument 'roles' must have one letter per schema argument (", arguments.size(), ", at most ", kMaxArgs,
              "), got '", roles, "'");
  TORCH_CHECK(state->twin.schema().arguments().size() == arguments.size(), where, "the twin's schema differs");
  OpState& s = *state;
  s.num_args = static_cast<int>(arguments.size());
  for (int i = 0; i < s.num_args; ++i) {
    const char r = roles[i];
    const c10::TypeKind kind = arguments[i].type()->kind();
    // a vector or token tensor may be optional (Tensor?): a call passing None goes on to Python (serve's given())
    const bool optional = kind == c10::TypeKind::OptionalType &&
                          arguments[i].type()->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType;
    const bool tensor = kind == c10::TypeKind::TensorType || ((r == 'w' || r == 't') && optional);
    TORCH_CHECK(((r == 'r' || r == 'w' || r == 't' || r == 'c') && tensor) || (r == 'o' && optional) ||
                    ((r == 'f' || r == 'e') && kind == c10::TypeKind::FloatType) ||
                    (r == 'i' && kind == c10::TypeKind::IntType) || (r == 'b' && kind == c10::TypeKind::BoolType) ||
                    (r == 's' && kind == c10::TypeKind::StringType),
                where, "argument 'roles': '", r, "' for argument '", arguments[i].name(), "' of type ", arguments[i].type()->str());
    s.roles[i] = r;
    if (tensor) s.tensors[s.num_tensors++] = i;
    s.num_facts += r == 't' ? 3 : r == 'c' ? 2 : r == 'i' || r == 'b' || r == 's' || r == 'o' || r == 'e' ? 1 : 0;
    if (arguments[i].alias_info() != nullptr && arguments[i].alias_info()->isWrite()) {
      TORCH_CHECK(r == 'r' || r == 't', where, "argument 'roles': the written argument '", arguments[i].name(),
                  "' must be rows (r) or a token tensor (t), got '", r, "'");
      s.written[s.num_written++] = i;
    }
  }
  for (const char want : {'r', 't'}) {
    for (int i = 0; i < s.num_args && s.data < 0; ++i) {
      if (s.roles[i] == want) s.data = i;
    }
  }
  TORCH_CHECK(s.data >= 0, where, "argument 'roles' has no 'r' or 't' (the data argument)");
  TORCH_CHECK(output.empty() || output == "p" || s.roles[s.data] == 'r', where,
              "an output is shaped like rows: argument 'roles' needs an 'r'");
  const bool all_tensors = std::all_of(returns.begin(), returns.end(),
                                       [](const c10::Argument& a) { return a.type()->kind() == c10::TypeKind::TensorType; });
  TORCH_CHECK((output.empty() && returns.empty()) || ((output == "r" || output == "h") && returns.size() == 1 && all_tensors) ||
                  (output == "p" && !returns.empty() && returns.size() <= static_cast<size_t>(kMaxOutputs) && all_tensors),
              where, "argument 'output' '", output, "' does not match the schema's ", returns.size(), " returns");
  s.output = output.empty() ? 0 : output[0];
  s.num_outputs = static_cast<int>(returns.size());
  std::vector<int> seen(arguments.size() + kMaxOutputs, 0);  // by index + kMaxOutputs
  int passed = 0;  // the arguments the host function takes: all but the ints, bools and strings
  const auto fixed = [&](int64_t i) { return s.roles[i] == 'i' || s.roles[i] == 'b' || s.roles[i] == 's'; };
  for (int i = 0; i < s.num_args; ++i) passed += !fixed(i);
  bool ok = call.size() == static_cast<size_t>(passed + (s.output ? s.num_outputs : 0));
  for (size_t k = 0; ok && k < call.size(); ++k) {
    const int64_t i = call[k];
    ok = i >= -(s.output ? s.num_outputs : 0) && i < s.num_args && (i < 0 || !fixed(i)) && seen[i + kMaxOutputs]++ == 0;
    s.call[k] = static_cast<int>(i);
  }
  TORCH_CHECK(ok, where, "argument 'call' must hold every argument's index once but the ints', bools' and strings', and "
              "-1 - k for output k");
  s.num_call = static_cast<int>(call.size());
  register_kernels(name, std::move(state));
}

const OpState* find_installed(const std::string& name) {
  for (const auto& s : g_ops) {
    if (s->name == name) return s.get();
  }
  return nullptr;
}

const OpState& installed(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_install);
  const OpState* s = find_installed(name);
  TORCH_CHECK(s != nullptr, "deepinfer_fast_path::publish: argument 'op' must be an op installed here, got '", name, "'");
  return *s;
}

// Registers the CUDA and Autograd kernels of `op`'s out overload (after `install(op, ...)`, and after
// ``deepinfer::<op>.out`` and its twin are defined): the op's HostCall, its output taken from the
// overload's last argument, served by the signatures published for the op.
void install_out(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_install);
  const std::string where = "deepinfer_fast_path::install_out(" + name + "): ";
  const OpState* op = find_installed(name);
  TORCH_CHECK(op != nullptr, where, "install the op first");
  TORCH_CHECK(op->output != 0, where, "an op that returns no tensor has no out overload");
  TORCH_CHECK(op->output != 'p', where, "the out overload of an op of several outputs is not served here");
  TORCH_CHECK(find_installed(name + ".out") == nullptr, where, "installed already");
  const c10::OperatorHandle out = defined("deepinfer::" + name, "out");
  const c10::OperatorHandle twin = defined("deepinfer_py::" + name, "out");
  const auto& arguments = out.schema().arguments();
  TORCH_CHECK(static_cast<int>(arguments.size()) == op->num_args + 1 && twin.schema().arguments().size() == arguments.size() &&
                  arguments.back().type()->kind() == c10::TypeKind::TensorType && arguments.back().alias_info() != nullptr &&
                  arguments.back().alias_info()->isWrite(),
              where, "the out overload must take the op's arguments then one written tensor, in it and its twin");
  auto state = std::make_unique<OpState>(*op);
  state->name = name + ".out";
  state->twin = twin;
  state->given_output = true;
  register_kernels(name + ".out", std::move(state));
}


// Registers the CUDA and Autograd kernels of ``deepinfer::<op>`` (``overload``: that overload of it) served
// by recorded launches, after the op and its twin are defined.
void install_recorded(const std::string& name, const std::string& overload) {
  std::lock_guard<std::mutex> lock(g_install);
  const std::string full = overload.empty() ? name : name + "." + overload;
  const std::string where = "deepinfer_fast_path::install_recorded(" + full + "): ";
  TORCH_CHECK(find_installed(full) == nullptr, where, "installed already");
  const c10::OperatorHandle op = defined("deepinfer::" + name, overload);
  auto state = std::make_unique<OpState>(static_cast<int>(g_ops.size()), full, defined("deepinfer_py::" + name, overload));
  const auto& arguments = op.schema().arguments();
  TORCH_CHECK(arguments.size() <= static_cast<size_t>(kMaxArgs) && state->twin.schema().arguments().size() == arguments.size(),
              where, "at most ", kMaxArgs, " arguments, the twin's as many");
  for (const c10::Argument& r : op.schema().returns()) {
    TORCH_CHECK(r.type()->kind() == c10::TypeKind::TensorType, where, "every return must be a tensor");
  }
  OpState& s = *state;
  s.recorded = true;
  s.num_args = static_cast<int>(arguments.size());
  s.num_outputs = static_cast<int>(op.schema().returns().size());
  for (int i = 0; i < s.num_args; ++i) {
    if (arguments[i].alias_info() != nullptr && arguments[i].alias_info()->isWrite()) {
      const c10::TypeKind kind = arguments[i].type()->kind();
      TORCH_CHECK(kind == c10::TypeKind::TensorType ||
                      (kind == c10::TypeKind::OptionalType &&
                       arguments[i].type()->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType),
                  where, "a written argument must be a Tensor or Tensor?");
      s.written[s.num_written++] = i;
    }
  }
  register_kernels(full, std::move(state));
}

// The signature of the innermost call of `op` passed on to its twin on this thread, when it may be recorded
// (the call's arguments all read, fewer than kMaxRecordings signatures recorded for the op); else None.
std::optional<std::vector<int64_t>> pending(const std::string& name) {
  for (auto it = t_pending.rbegin(); it != t_pending.rend(); ++it) {
    if (it->first->name != name) continue;
    if (it->second.empty()) return std::nullopt;
    int count = 0;
    for (const Recording& r : *g_recordings.load(std::memory_order_acquire)) count += r.op == it->first->index;
    if (count >= kMaxRecordings) return std::nullopt;
    return std::vector<int64_t>(it->second.begin(), it->second.end());
  }
  return std::nullopt;
}

// Publishes what the twin recorded for the pending call of `op` (its signature from ``pending``):
//   allocations: per allocation its dims n, n sizes, n strides (dtypes in `allocation_dtypes`);
//   returns:     per schema return its source (-1 - k allocation k, i argument i), dims n, n sizes, n strides,
//                offset in elements;
//   launches:    per launch its CUfunction, grid x, y, z, threads, shared bytes, parameters p, patches q;
//   slots:       per launch its p parameters' recorded values, then their p sizes in bytes (checked against
//                the function where the driver tells them);
//   patches:     per launch q (parameter, source, byte offset): the pointer parameters.
void record(const std::string& name, int64_t device, const std::vector<int64_t>& key, const std::vector<int64_t>& allocations,
            const std::optional<std::vector<c10::ScalarType>>& allocation_dtypes, const std::vector<int64_t>& returns,
            const std::vector<int64_t>& launches, const std::vector<int64_t>& slots, const std::vector<int64_t>& patches) {
  const OpState& s = installed(name);
  const std::string where = "deepinfer_fast_path::record(" + name + "): ";
  TORCH_CHECK(s.recorded, where, "the op is served by its HostCall, not by recorded launches");
  TORCH_CHECK(!key.empty(), where, "argument 'key' is empty");
  Recording r{s.index, static_cast<c10::DeviceIndex>(device), key, {}, {}, {}};
  const std::vector<c10::ScalarType> dtypes = allocation_dtypes.value_or(std::vector<c10::ScalarType>());
  size_t at = 0;
  const auto take = [&](const std::vector<int64_t>& from, size_t& pos, const char* what) {
    TORCH_CHECK(pos < from.size(), where, "argument '", what, "' ends early");
    return from[pos++];
  };
  const auto take_shape = [&](const std::vector<int64_t>& from, size_t& pos, const char* what, std::vector<int64_t>& sizes,
                              std::vector<int64_t>& strides) {
    const int64_t n = take(from, pos, what);
    TORCH_CHECK(n >= 0 && n <= 8, where, "argument '", what, "': dims must be 0 to 8");
    for (int64_t d = 0; d < n; ++d) sizes.push_back(take(from, pos, what));
    for (int64_t d = 0; d < n; ++d) strides.push_back(take(from, pos, what));
  };
  for (size_t k = 0; at < allocations.size(); ++k) {
    TORCH_CHECK(k < dtypes.size(), where, "argument 'allocation_dtypes' must hold one dtype per allocation");
    Allocation a{dtypes[k], {}, {}};
    take_shape(allocations, at, "allocations", a.sizes, a.strides);
    r.allocations.push_back(std::move(a));
  }
  TORCH_CHECK(dtypes.size() == r.allocations.size(), where, "argument 'allocation_dtypes' must hold one dtype per allocation");
  // which arguments the key says are tensors (a source >= 0 must be one)
  std::vector<bool> tensor(s.num_args, false);
  size_t word = 0;
  for (int i = 0; i < s.num_args; ++i) {
    const int64_t tag = take(key, word, "key");
    tensor[i] = tag == 1;
    const int64_t skip = tag == 1 ? 4 : tag == 6 ? take(key, word, "key") : tag == 0 ? 0 : 1;
    TORCH_CHECK(tag >= 0 && tag <= 6 && skip >= 0, where, "argument 'key' is not a signature of ", s.num_args, " arguments");
    word += skip;
    if (tag == 1) {  // its dims, then its sizes and strides
      const int64_t dims = take(key, word, "key");
      TORCH_CHECK(dims >= 0, where, "argument 'key' is not a signature of ", s.num_args, " arguments");
      word += 2 * dims;
    }
  }
  TORCH_CHECK(word == key.size(), where, "argument 'key' is not a signature of ", s.num_args, " arguments");
  const int64_t num_allocations = static_cast<int64_t>(r.allocations.size());
  const auto source_ok = [&](int64_t source) {
    return source >= -num_allocations && source < s.num_args && (source < 0 || tensor[source]);
  };
  at = 0;
  while (at < returns.size()) {
    Return ret{take(returns, at, "returns"), {}, {}, 0};
    take_shape(returns, at, "returns", ret.sizes, ret.strides);
    ret.offset = take(returns, at, "returns");
    TORCH_CHECK(source_ok(ret.source) && ret.offset >= 0, where, "argument 'returns': a bad source or offset");
    r.returns.push_back(std::move(ret));
  }
  TORCH_CHECK(static_cast<int>(r.returns.size()) == s.num_outputs, where, "argument 'returns' must describe the op's ",
              s.num_outputs, " returns, got ", r.returns.size());
  for (int64_t k = 0; k < num_allocations; ++k) {
    Allocation& a = r.allocations[k];
    if (std::any_of(r.returns.begin(), r.returns.end(), [&](const Return& ret) { return ret.source == -1 - k; })) continue;
    const auto bytes = layout_bytes(a.sizes, a.strides, static_cast<int64_t>(c10::elementSize(a.dtype)));
    TORCH_CHECK(bytes, where, "argument 'allocations': negative sizes or strides");
    a.scratch_offset = r.scratch_bytes;
    r.scratch_bytes += (*bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
  }
  size_t slot_at = 0, patch_at = 0;
  std::vector<std::vector<int64_t>> slot_sizes;  // per launch, its parameters' sizes in bytes
  at = 0;
  while (at < launches.size()) {
    Launch l{reinterpret_cast<void*>(take(launches, at, "launches")), {}, 0, 0, {}, {}};
    for (unsigned& g : l.grid) g = static_cast<unsigned>(take(launches, at, "launches"));
    l.block = static_cast<unsigned>(take(launches, at, "launches"));
    l.shared = static_cast<unsigned>(take(launches, at, "launches"));
    const int64_t num_slots = take(launches, at, "launches"), num_patches = take(launches, at, "launches");
    TORCH_CHECK(l.function != nullptr && l.block >= 1 && l.block <= 1024 && num_slots >= 0 && num_slots <= 32 &&
                    num_patches >= 0 && num_patches <= num_slots,
                where, "argument 'launches': a launch needs a function, 1-1024 threads, at most 32 parameters");
    for (int64_t p = 0; p < num_slots; ++p) l.slots.push_back(take(slots, slot_at, "slots"));
    std::vector<int64_t>& sizes = slot_sizes.emplace_back();
    for (int64_t p = 0; p < num_slots; ++p) {
      sizes.push_back(take(slots, slot_at, "slots"));
      TORCH_CHECK(sizes.back() == 1 || sizes.back() == 2 || sizes.back() == 4 || sizes.back() == 8, where,
                  "argument 'slots': a parameter is 1, 2, 4 or 8 bytes");
    }
    for (int64_t q = 0; q < num_patches; ++q) {
      std::array<int64_t, 3> patch{take(patches, patch_at, "patches"), take(patches, patch_at, "patches"),
                                   take(patches, patch_at, "patches")};
      TORCH_CHECK(patch[0] >= 0 && patch[0] < num_slots && source_ok(patch[1]), where, "argument 'patches': a bad parameter or source");
      l.patches.push_back(patch);
    }
    r.launches.push_back(std::move(l));
  }
  TORCH_CHECK(slot_at == slots.size() && patch_at == patches.size(), where, "arguments 'slots' and 'patches' hold more than the launches take");
  bind_driver();
  for (size_t k = 0; k < r.launches.size() && g_param_info != nullptr; ++k) {  // the parameters as the driver has them
    const auto& sizes = slot_sizes[k];
    for (size_t p = 0; p <= sizes.size(); ++p) {
      size_t offset = 0, bytes = 0;
      const int rc = g_param_info(r.launches[k].function, p, &offset, &bytes);
      TORCH_CHECK(p < sizes.size() ? rc == 0 && bytes == static_cast<size_t>(sizes[p]) : rc != 0, where, "parameter ", p,
                  " of recorded kernel ", k, " is ", rc == 0 ? std::to_string(bytes) + " bytes" : std::string("not there"),
                  ", recorded as ", p < sizes.size() ? std::to_string(sizes[p]) + " bytes" : std::string("not there"));
    }
  }
  std::lock_guard<std::mutex> lock(g_write);
  swap_in(g_recordings, g_retired_recordings, [&](std::vector<Recording>& table) { table.push_back(std::move(r)); });
}

void publish(const std::string& name, const std::vector<c10::ScalarType>& dtypes, int64_t hidden, int64_t device,
             const std::vector<int64_t>& from, const std::vector<int64_t>& kernels, const std::vector<int64_t>& facts,
             const std::vector<int64_t>& granules, const std::optional<std::vector<c10::ScalarType>>& laid_dtypes,
             const std::optional<std::vector<int64_t>>& laid_shapes, int64_t max_tokens) {
  // None for an op of one output or none (an empty ScalarType[] cannot be passed: it arrives as int[])
  const std::vector<c10::ScalarType> out_dtypes = laid_dtypes.value_or(std::vector<c10::ScalarType>());
  const std::vector<int64_t> out_shapes = laid_shapes.value_or(std::vector<int64_t>());
  const OpState& s = installed(name);
  TORCH_CHECK(!s.recorded, "deepinfer_fast_path::publish: argument 'op' must be an op its HostCall serves, got '", name,
              "' (served by recorded launches)");
  const int outputs = s.output == 'p' ? s.num_outputs : 0;
  TORCH_CHECK(static_cast<int>(out_dtypes.size()) == outputs && static_cast<int>(out_shapes.size()) == 2 * outputs,
              "deepinfer_fast_path::publish: arguments 'out_dtypes' and 'out_shapes' must hold ", outputs, " and ",
              2 * outputs, " values for ", name, " (a dtype, then a layout and a width, per output it lays out), got ",
              out_dtypes.size(), " and ", out_shapes.size());
  TORCH_CHECK(static_cast<int>(dtypes.size()) == s.num_tensors, "deepinfer_fast_path::publish: argument 'dtypes' must hold ",
              s.num_tensors, " dtypes for ", name, ", got ", dtypes.size());
  const int n = static_cast<int>(kernels.size());
  TORCH_CHECK(n >= 1 && n <= kMaxKernels && from.size() == kernels.size() && from[0] == 0,
              "deepinfer_fast_path::publish: arguments 'from' and 'kernels' must hold 1 to ", kMaxKernels,
              " entries each, 'from' starting at 0, got ", from.size(), " and ", n);
  TORCH_CHECK(static_cast<int>(facts.size()) == s.num_facts && static_cast<int>(granules.size()) == s.num_args,
              "deepinfer_fast_path::publish: arguments 'facts' and 'granules' must hold ", s.num_facts, " and ", s.num_args,
              " values for ", name, ", got ", facts.size(), " and ", granules.size());
  TORCH_CHECK(max_tokens >= 0, "deepinfer_fast_path::publish: argument 'max_tokens' must be >= 0 (0: no limit), for ", name);
  Entry entry{s.index, hidden, static_cast<c10::DeviceIndex>(device), {}, {}, {}, n, max_tokens, {}, {}, {}, {}, {}};
  for (int o = 0; o < outputs; ++o) {
    const c10::ScalarType t = out_dtypes[o];
    const int64_t layout = out_shapes[2 * o], width = out_shapes[2 * o + 1];
    const bool shaped = layout == kLike ? width >= 0 && width < s.num_args && s.roles[width] == 't'
                                        : layout >= kRows && layout <= kColumn && s.roles[s.data] == 'r' && width >= 1 &&
                                              ((layout != kToken && layout != kOne) || width == 1);
    TORCH_CHECK((t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Half || t == c10::ScalarType::Float ||
                 t == c10::ScalarType::Float8_e4m3fn) && shaped,
                "deepinfer_fast_path::publish: an output is float16, bfloat16, float32 or float8_e4m3fn, of layout 0-3 "
                "over rows with width >= 1 (1 for layouts 1 and 2) or of layout 4 like a t argument, for ", name);
    entry.out_dtype[o] = t;
    entry.out_layout[o] = static_cast<int8_t>(layout);
    entry.out_width[o] = width;
  }
  for (int f = 0; f < s.num_facts; ++f) entry.facts[f] = facts[f];
  for (int i = 0; i < s.num_args; ++i) {
    TORCH_CHECK(granules[i] >= 0 && (granules[i] == 0 || s.roles[i] == 't' || s.roles[i] == 'c'),
                "deepinfer_fast_path::publish: a granule is >= 0, and 0 but for a t or c tensor, for ", name);
    entry.granule[i] = granules[i];
  }
  for (int k = 0; k < n; ++k) {
    TORCH_CHECK(kernels[k] != 0 && (k == 0 || from[k] > from[k - 1]),
                "deepinfer_fast_path::publish: 'from' must ascend and every kernel be a handle, for ", name);
    entry.from[k] = from[k];
    entry.kernel[k] = reinterpret_cast<void*>(kernels[k]);
  }
  for (int k = 0; k < s.num_tensors; ++k) {
    const c10::ScalarType t = dtypes[k];
    const bool index = s.roles[s.tensors[k]] == 't' || s.roles[s.tensors[k]] == 'c';
    TORCH_CHECK(t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Half || t == c10::ScalarType::Float ||
                    (index && (t == c10::ScalarType::Int || t == c10::ScalarType::Long)),
                "deepinfer_fast_path::publish: dtypes must be float16, bfloat16 or float32 (int32 or int64 for a t or c "
                "tensor), got ", t);
    entry.dtypes[k] = t;
  }
  const bool rows = s.roles[s.data] == 'r';
  TORCH_CHECK(rows ? hidden > 0 && (s.output != 'h' || hidden % 2 == 0) : hidden == 0,
              "deepinfer_fast_path::publish: bad entry for ", name);
  bind_ffi();
  for (int k = 0; k < n; ++k) g_ffi.inc_ref(entry.kernel[k]);
  edit_table([&](std::vector<Entry>& table) { table.push_back(entry); });
}

// The fact standing for `value` in a published signature (publish's facts hold it for an s argument).
int64_t intern(const std::string& value) {
  std::lock_guard<std::mutex> lock(g_write);
  const int64_t found = string_fact(value);
  if (found >= 0) return found;
  swap_in(g_strings, g_retired_strings, [&](std::vector<std::string>& strings) { strings.push_back(value); });
  return static_cast<int64_t>(g_strings.load()->size()) - 1;
}

void clear() {
  edit_table([](std::vector<Entry>& table) { table.clear(); });
  std::lock_guard<std::mutex> lock(g_write);
  swap_in(g_recordings, g_retired_recordings, [](std::vector<Recording>& table) { table.clear(); });
}

std::vector<int64_t> counters() {
  return {static_cast<int64_t>(g_table.load()->size() + g_recordings.load()->size()), g_hits.load(), g_misses.load()};
}

}  // namespace

TORCH_LIBRARY(deepinfer_fast_path, m) {
  m.def("install(str op, str roles, str output, int[] call) -> ()", &install);
  m.def("install_out(str op) -> ()", &install_out);
  m.def("publish(str op, ScalarType[] dtypes, int hidden, int device, int[] from, int[] kernels, int[] facts, "
        "int[] granules, ScalarType[]? out_dtypes=None, int[]? out_shapes=None, int max_tokens=0) -> ()", &publish);
  m.def("intern(str value) -> int", &intern);
  m.def("install_recorded(str op, str overload) -> ()", &install_recorded);
  m.def("pending(str op) -> int[]?", &pending);
  m.def("record(str op, int device, int[] key, int[] allocations, ScalarType[]? allocation_dtypes, int[] returns, "
        "int[] launches, int[] slots, int[] patches) -> ()", &record);
  m.def("clear() -> ()", &clear);
  m.def("counters() -> int[]", &counters);  // [signatures published, calls served, calls passed on]
}
