// omnigen's op shim: the CUDA kernels of omnigen::attention and omnigen::attention_backward, in C++, so that a
// call goes from PyTorch's dispatcher to a generated module's launch with no Python in between.
//
// The ops themselves -- schemas, fake kernels, CPU autograd -- are defined in Python (omnigen/op/library.py, which
// also keeps the Python kernels used where this library is not built); this library adds their CUDA kernels and
// their autograd on CUDA tensors. torch.library's autograd layer is Python: without the C++ one every call under
// torch.compile (where AOTAutograd's graphs call the ops with grad off) still went through a Python function
// before reaching the kernel (about 15 us a call on a 2-core CPU).
// Built once per torch version by omnigen.jit (cache.get_host_library), loaded by omnigen/op/native/__init__.py.
//
// Which module runs a call -- the kernel's tuned forward or backward config for the sequence length -- is asked of
// Python once per (kernel key, seq_len, head_dim, dtype, device, pass) through the op omnigen::_launch_choice,
// and kept here; omnigen::_forget_launch_choices drops what is kept (the tuning database changed). The generated
// modules export their launches as addresses (omnigen/launch_abi.h); this file fills the same argument structs.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "omnigen/launch_abi.h"

namespace {

// Schedule tensors per tile shape, in omnigen.plan.masks.SCHEDULE_TENSORS' order (omnigen/op/native/__init__.py checks it).
enum Schedule : int64_t {
  kFwdPtr, kFwdKv, kBwdPtr, kBwdQ, kPartialSlot, kPartialBits, kPartialSlotBwd, kPartialBitsBwd, kPerShape
};

// What a module reads besides the arguments every launch takes (omnigen/op/native/__init__.py: PERSISTENT_FORWARD...).
enum Flag : int64_t {
  kPersistentForward = 1, kPartialBitsFlag = 2, kOrderedDq = 4, kGroupDkdv = 8, kDqInterleaved = 16,
  kPersistentBackward = 32
};

// One pass's launch, as omnigen::_launch_choice returned it: int64 [block_m, block_n, forward, backward, delta,
// flags, launch ABI, convert].
struct LaunchChoice {
  int64_t block_m = 0, block_n = 0;
  omnigen::ForwardLaunch forward = nullptr;
  omnigen::BackwardLaunch backward = nullptr;
  omnigen::DeltaLaunch delta = nullptr;
  omnigen::ConvertLaunch convert = nullptr;
  int64_t flags = 0;
};
constexpr int64_t kChoiceFields = 8;

std::mutex choices_mutex;
std::unordered_map<std::string, LaunchChoice> choices;

LaunchChoice launch_choice(c10::string_view kernel, const at::Tensor& q, bool backward) {
  std::string key(kernel.data(), kernel.size());
  for (int64_t part : {q.size(2), q.size(3), int64_t(q.scalar_type()), int64_t(q.get_device()), int64_t(backward)}) {
    key += '|' + std::to_string(part);
  }
  {
    std::lock_guard<std::mutex> lock(choices_mutex);
    auto found = choices.find(key);
    if (found != choices.end()) return found->second;
  }
  // First call of this shape: Python resolves the kernel key, picks the config and loads (or builds) its module.
  static auto ask = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("omnigen::_launch_choice", "")
                        .typed<at::Tensor(c10::string_view, const at::Tensor&, bool)>();
  const at::Tensor fields = ask.call(kernel, q, backward);
  TORCH_CHECK(fields.scalar_type() == at::kLong && fields.device().is_cpu() && fields.numel() == kChoiceFields,
              "omnigen::_launch_choice must return ", kChoiceFields, " int64 values on the CPU");
  const int64_t* f = fields.contiguous().data_ptr<int64_t>();
  TORCH_CHECK(f[6] == omnigen::kLaunchAbi, "omnigen: a module of launch ABI ", f[6], " met the op shim of ABI ",
              omnigen::kLaunchAbi, "; clear the kernel cache (omnigen cache clear) to rebuild both");
  LaunchChoice choice;
  choice.block_m = f[0], choice.block_n = f[1];
  choice.forward = reinterpret_cast<omnigen::ForwardLaunch>(static_cast<uintptr_t>(f[2]));
  choice.backward = reinterpret_cast<omnigen::BackwardLaunch>(static_cast<uintptr_t>(f[3]));
  choice.delta = reinterpret_cast<omnigen::DeltaLaunch>(static_cast<uintptr_t>(f[4]));
  choice.convert = reinterpret_cast<omnigen::ConvertLaunch>(static_cast<uintptr_t>(f[7]));
  choice.flags = f[5];  // (the launch addresses are non-zero: Python's launch_choice refuses a module without them)
  std::lock_guard<std::mutex> lock(choices_mutex);
  choices[key] = choice;
  return choice;
}

void forget_launch_choices() {
  std::lock_guard<std::mutex> lock(choices_mutex);
  choices.clear();
}

// The kernels need a contiguous last dim and 16-byte aligned rows: copy only when that fails (op's kernel_ready).
at::Tensor kernel_ready(const at::Tensor& t) {
  bool aligned = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; aligned && d + 1 < t.dim(); ++d) aligned = t.stride(d) % 8 == 0;
  return aligned ? t : t.contiguous();
}

// The schedules of one tile shape in the op's flat lists (library.schedules_for says the same in Python).
at::TensorList schedules_for(at::TensorList schedules, c10::SymIntArrayRef tiles, const LaunchChoice& choice) {
  const int64_t shapes = int64_t(tiles.size()) / 2;
  TORCH_CHECK_VALUE(!tiles.empty() && tiles.size() % 2 == 0 && int64_t(schedules.size()) == kPerShape * shapes,
                    "omnigen::attention: ", schedules.size(), " schedule tensors for ", shapes, " tile shapes (",
                    int64_t(kPerShape), " per shape)");
  std::string have;
  for (int64_t i = 0; i < shapes; ++i) {
    const int64_t m = tiles[2 * i].expect_int(), n = tiles[2 * i + 1].expect_int();
    if (m == choice.block_m && n == choice.block_n) return schedules.slice(kPerShape * i, kPerShape);
    have += (have.empty() ? "" : ", ") + std::to_string(m) + "x" + std::to_string(n);
  }
  TORCH_CHECK_VALUE(false, "the mask has no plan for ", choice.block_m, "x", choice.block_n,
                    " tiles, which this kernel runs at this sequence length (it has ", have,
                    "); make it with omnigen.mask(rules, layout, device, head_dim=..., dtype=...) for this head dim "
                    "and dtype, or with kernel.mask(layout) (masks from mask_from_mod, mask_from_dense and "
                    "mask_from_intervals take the same head_dim= and dtype=)");
}

template <typename T>
const T* address(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : static_cast<const T*>(t.data_ptr());
}

// What ForwardArgs and BackwardArgs share: q, k, v, the sizes, the forward schedule and the token tables.
template <typename Args>
void set_shared(Args& args, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList plan,
                const at::Tensor& token_segment, const at::Tensor& token_modality, const at::Tensor& token_doc,
                double scale, int64_t block_m) {
  const std::string problem = omnigen::size_problem(q.size(0), q.size(1), k.size(1), q.size(2), block_m, scale);
  TORCH_CHECK_VALUE(problem.empty(), problem);
  args.q = q.data_ptr(), args.k = k.data_ptr(), args.v = v.data_ptr();
  args.q_stride_b = q.stride(0), args.q_stride_h = q.stride(1), args.q_stride_s = q.stride(2);
  args.k_stride_b = k.stride(0), args.k_stride_h = k.stride(1), args.k_stride_s = k.stride(2);
  args.v_stride_b = v.stride(0), args.v_stride_h = v.stride(1), args.v_stride_s = v.stride(2);
  args.batch = int(q.size(0)), args.heads_q = int(q.size(1)), args.heads_kv = int(k.size(1));
  args.seq_len = int(q.size(2));
  args.scale = float(scale);
  args.fwd_ptr = address<int32_t>(plan[kFwdPtr]);
  args.fwd_kv = address<int32_t>(plan[kFwdKv]);
  args.token_segment = address<int32_t>(token_segment);
  args.token_modality = address<int32_t>(token_modality);
  args.token_doc = address<int32_t>(token_doc);
}

// A mask's partial tiles as bits (omnigen.plan.bits), whole slots of block_m x block_n bits (the binding's check).
template <typename Args>
void set_partial_bits(Args& args, const LaunchChoice& choice, const at::Tensor& slot, const at::Tensor& bits,
                      int64_t slot_words) {
  const int64_t words = bits.numel();
  if (!(choice.flags & kPartialBitsFlag) || words == 0) return;
  TORCH_CHECK_VALUE(words % slot_words == 0, "partial_bits must be a whole number of slots of ", slot_words,
                    " words (omnigen.plan.bits), got ", words);
  args.partial_slot = address<int32_t>(slot);
  args.partial_bits = address<uint32_t>(bits);
  args.partial_slots = int(words / slot_words);
}

void raise_unless_ok(int status, const char* message) { TORCH_CHECK(status == 0, message); }

// An uninitialised [B, H, S, D] tensor stored as [B, S, H, D]: the layout of every tensor the ops return (the
// Python path's kernels.launch.heads_inner says why). The kernels take any row strides.
at::Tensor heads_inner(int64_t B, int64_t H, int64_t S, int64_t D, const at::TensorOptions& options) {
  return at::empty({B, S, H, D}, options).transpose(1, 2);
}

// The current stream of q's device as a cudaStream_t, through c10's device-generic interface: no CUDA headers or
// libraries here, so the shim builds (and loads) against any torch, a CPU-only one included.
uintptr_t current_stream(const at::Tensor& q) {
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device());
  return reinterpret_cast<uintptr_t>(stream.native_handle());
}

std::tuple<at::Tensor, at::Tensor> attention_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, at::TensorList schedules,
    c10::SymIntArrayRef tiles, const at::Tensor& token_segment, const at::Tensor& token_modality,
    const at::Tensor& token_doc, c10::string_view kernel, double scale, bool deterministic) {
  const c10::DeviceGuard guard(q_in.device());
  const LaunchChoice choice = launch_choice(kernel, q_in, /*backward=*/false);
  const at::TensorList plan = schedules_for(schedules, tiles, choice);
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  at::Tensor out = heads_inner(B, Hq, S, D, q.options());
  at::Tensor lse = at::empty({B, Hq, S}, q.options().dtype(at::kFloat));
  // The persistent forward takes its work tiles from a counter, a fresh one per call (two streams never share one),
  // which the module's launch zeroes on the stream.
  at::Tensor counter;
  omnigen::ForwardArgs args{};
  set_shared(args, q, k, v, plan, token_segment, token_modality, token_doc, scale, choice.block_m);
  args.o = out.data_ptr();
  args.lse = lse.data_ptr<float>();
  args.o_stride_b = out.stride(0), args.o_stride_h = out.stride(1), args.o_stride_s = out.stride(2);
  if (choice.flags & kPersistentForward) {
    counter = at::empty({1}, q.options().dtype(at::kInt));
    args.tile_counter = counter.data_ptr<int32_t>();
  }
  set_partial_bits(args, choice, plan[kPartialSlot], plan[kPartialBits],
                   ((choice.block_n + 127) / 128) * choice.block_m * 4);
  char message[1024] = {0};
  raise_unless_ok(choice.forward(args, current_stream(q), message, sizeof message), message);
  return {out, lse};
}

// The order of deterministic mode's dQ additions (omnigen.plan.schedule.dq_ranks), asked of Python.
at::Tensor dq_ranks(at::TensorList plan, int64_t batch, int64_t q_tiles, int64_t kv_tiles) {
  static auto ask = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("omnigen::_dq_ranks", "")
                        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          int64_t, int64_t, int64_t)>();
  return ask.call(plan[kFwdPtr], plan[kFwdKv], plan[kBwdPtr], plan[kBwdQ], batch, q_tiles, kv_tiles);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& d_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, at::TensorList schedules, c10::SymIntArrayRef tiles,
    const at::Tensor& token_segment, const at::Tensor& token_modality, const at::Tensor& token_doc,
    c10::string_view kernel, double scale, bool deterministic) {
  const c10::DeviceGuard guard(q_in.device());
  const LaunchChoice choice = launch_choice(kernel, q_in, /*backward=*/true);  // Python raises if none
  const at::TensorList plan = schedules_for(schedules, tiles, choice);
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  const at::Tensor out = kernel_ready(out_in), d_out = kernel_ready(d_out_in);
  const at::Tensor lse = lse_in.contiguous();  // the kernels index it as [B, Hq, S] with no strides
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1);
  const auto f32 = q.options().dtype(at::kFloat);
  const uintptr_t stream = current_stream(q);
  char message[1024] = {0};

  at::Tensor delta = at::empty({B, Hq, S}, f32);  // dO . O per row
  at::Tensor dq_accum = at::empty({B, Hq, S, D}, f32);  // zeroed by the Delta pass
  // The backward's int32 counters, zeroed by the Delta pass too: deterministic mode's semaphores, one per (batch,
  // query head, 64-row block of dQ), or the persistent backward's kv-tile counter (a fresh one per call, as the
  // forward's: two streams never share one). Held until the launches are queued: the caching allocator may hand a
  // freed block to the next tensor.
  const bool ordered = deterministic && (choice.flags & kOrderedDq);
  at::Tensor counters;
  if (ordered) {
    counters = at::empty({B, Hq, (S + 63) / 64}, q.options().dtype(at::kInt));
  } else if (!deterministic && (choice.flags & kPersistentBackward)) {
    counters = at::empty({1}, q.options().dtype(at::kInt));
  }
  omnigen::DeltaArgs delta_args{};
  delta_args.o = out.data_ptr(), delta_args.d_o = d_out.data_ptr(), delta_args.delta = delta.data_ptr<float>();
  delta_args.o_stride_b = out.stride(0), delta_args.o_stride_h = out.stride(1), delta_args.o_stride_s = out.stride(2);
  delta_args.d_o_stride_b = d_out.stride(0), delta_args.d_o_stride_h = d_out.stride(1);
  delta_args.d_o_stride_s = d_out.stride(2);
  delta_args.batch = int(B), delta_args.heads_q = int(Hq), delta_args.seq_len = int(S);
  delta_args.dq_accum = dq_accum.data_ptr<float>();
  if (counters.defined()) {
    delta_args.zero_ints = counters.data_ptr<int32_t>();
    delta_args.zero_int_count = counters.numel();
  }
  raise_unless_ok(choice.delta(delta_args, stream, message, sizeof message), message);

  const bool partials = Hq != Hkv;
  // GQA: the kernel adds each group's dK/dV in fp32 itself (atomic mode of GROUP_DKDV modules, groups a power of
  // two), else writes fp32 per query head and the groups are summed below (deterministic: a fixed order). As
  // omnigen/kernels/launch.py.
  const int64_t group = partials ? Hq / Hkv : 1;
  const bool grouped = partials && !deterministic && (choice.flags & kGroupDkdv) && (group & (group - 1)) == 0;
  at::Tensor dk = heads_inner(B, Hkv, S, D, k.options()), dv = heads_inner(B, Hkv, S, D, v.options());
  const at::Tensor dk_kernel = grouped ? at::zeros({B, Hkv, S, D}, f32) : partials ? at::empty({B, Hq, S, D}, f32) : dk;
  const at::Tensor dv_kernel = grouped ? at::zeros({B, Hkv, S, D}, f32) : partials ? at::empty({B, Hq, S, D}, f32) : dv;

  omnigen::BackwardArgs args{};
  set_shared(args, q, k, v, plan, token_segment, token_modality, token_doc, scale, choice.block_m);
  args.d_o = d_out.data_ptr();
  args.lse = lse.data_ptr<float>();
  args.delta = delta.data_ptr<float>();
  args.dq_accum = dq_accum.data_ptr<float>();
  args.dk = dk_kernel.data_ptr(), args.dv = dv_kernel.data_ptr();
  args.d_o_stride_b = d_out.stride(0), args.d_o_stride_h = d_out.stride(1), args.d_o_stride_s = d_out.stride(2);
  args.dk_stride_b = dk_kernel.stride(0), args.dk_stride_h = dk_kernel.stride(1);
  args.dk_stride_s = dk_kernel.stride(2);
  args.dv_stride_b = dv_kernel.stride(0), args.dv_stride_h = dv_kernel.stride(1);
  args.dv_stride_s = dv_kernel.stride(2);
  args.bwd_ptr = address<int32_t>(plan[kBwdPtr]);
  args.bwd_q = address<int32_t>(plan[kBwdQ]);
  args.deterministic = deterministic ? 1 : 0;
  args.dkdv_group = grouped ? int(group) : 1;
  at::Tensor ranks;  // (held as the counters are)
  if (ordered) {
    const int64_t q_tiles = (S + choice.block_m - 1) / choice.block_m, kv_tiles = (S + choice.block_n - 1) / choice.block_n;
    ranks = dq_ranks(plan, B, q_tiles, kv_tiles);
    args.dq_rank = address<int32_t>(ranks);
  }
  if (counters.defined()) args.dq_semaphore = counters.data_ptr<int32_t>();
  set_partial_bits(args, choice, plan[kPartialSlotBwd], plan[kPartialBitsBwd],
                   ((choice.block_m + 127) / 128) * choice.block_n * 4);
  raise_unless_ok(choice.backward(args, stream, message, sizeof message), message);

  // The fp32 gradients out in the element type, by the module's own pass: copy_'s strided TensorIterator kernel took
  // 203 us against its 137 for dQ at d128, B x S = 4 x 8K, 16 heads on an H100, and more host time.
  auto convert = [&](const at::Tensor& source, const at::Tensor& destination, bool interleaved) {
    omnigen::ConvertArgs convert_args{};
    convert_args.source = source.data_ptr<float>();
    convert_args.destination = destination.data_ptr();
    convert_args.destination_stride_b = destination.stride(0), convert_args.destination_stride_h = destination.stride(1);
    convert_args.destination_stride_s = destination.stride(2);
    convert_args.batch = int(source.size(0)), convert_args.heads = int(source.size(1));
    convert_args.seq_len = int(source.size(2));
    convert_args.interleaved = interleaved ? 1 : 0;
    raise_unless_ok(choice.convert(convert_args, stream, message, sizeof message), message);
  };
  if (grouped) {
    convert(dk_kernel, dk, false);
    convert(dv_kernel, dv, false);
  } else if (partials) {
    dk.copy_(dk_kernel.view({B, Hkv, Hq / Hkv, S, D}).sum(2));
    dv.copy_(dv_kernel.view({B, Hkv, Hq / Hkv, S, D}).sum(2));
  }
  at::Tensor dq = heads_inner(B, Hq, S, D, q.options());
  convert(dq_accum, dq, (choice.flags & kDqInterleaved) != 0);
  return {dq, dk, dv};
}

// The op's autograd on CUDA tensors: what omnigen/op/autograd.py registers in Python, here in C++. Saves q, k, v,
// out, lse, the token tables and the schedules (the backward may run another tile shape than the forward), and calls
// omnigen::attention_backward through the dispatcher, so AOTAutograd traces that op into the backward graph.
struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      at::TensorList schedules, c10::SymIntArrayRef tiles, const at::Tensor& token_segment,
      const at::Tensor& token_modality, const at::Tensor& token_doc, c10::string_view kernel, double scale,
      bool deterministic) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("omnigen::attention", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                             c10::SymIntArrayRef, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             c10::string_view, double, bool)>();
    at::Tensor out, lse;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, lse) = op.call(q, k, v, schedules, tiles, token_segment, token_modality, token_doc, kernel, scale,
                                   deterministic);
    }
    torch::autograd::variable_list saved{q, k, v, out, lse, token_segment, token_modality, token_doc};
    saved.insert(saved.end(), schedules.begin(), schedules.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["tiles"] = tiles;
    ctx->saved_data["kernel"] = std::string(kernel.data(), kernel.size());
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // lse has no gradient: no zeros made for it (a fill launch every backward)
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("omnigen::attention_backward", "")
                         .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, at::TensorList, c10::SymIntArrayRef,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, double,
                             bool)>();
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const std::vector<at::Tensor> schedules(saved.begin() + 8, saved.end());
    const at::Tensor d_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const std::vector<c10::SymInt> tiles = ctx->saved_data["tiles"].toSymIntVector();
    const std::string kernel = ctx->saved_data["kernel"].toStringRef();
    auto [dq, dk, dv] = op.call(d_out, q, k, v, out, lse, schedules, tiles, saved[5], saved[6], saved[7], kernel,
                                ctx->saved_data["scale"].toDouble(), ctx->saved_data["deterministic"].toBool());
    // One entry per forward argument, each schedule tensor counted: q, k, v, then nothing for the rest.
    torch::autograd::variable_list gradients{dq, dk, dv};
    gradients.resize(3 + schedules.size() + 7);
    return gradients;
  }
};

std::tuple<at::Tensor, at::Tensor> attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList schedules,
    c10::SymIntArrayRef tiles, const at::Tensor& token_segment, const at::Tensor& token_modality,
    const at::Tensor& token_doc, c10::string_view kernel, double scale, bool deterministic) {
  const torch::autograd::variable_list outputs = AttentionFunction::apply(
      q, k, v, schedules, tiles, token_segment, token_modality, token_doc, kernel, scale, deterministic);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(omnigen, m) {
  m.def("_forget_launch_choices() -> ()", &forget_launch_choices);
}

TORCH_LIBRARY_IMPL(omnigen, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
}

// Registered for AutogradCUDA itself, which takes precedence over the Python autograd torch.library put under the
// Autograd alias key: CPU and meta tensors keep that one. The backward op has no derivative (no double backward).
TORCH_LIBRARY_IMPL(omnigen, AutogradCUDA, m) {
  m.impl("attention", &attention_autograd);
  m.impl("attention_backward", torch::autograd::autogradNotImplementedFallback());
}
