// omnigen: how native code outside a generated module calls its launches (the op shim, omnigen/op/native/).
// A module exports the addresses of its launch functions as integers (FORWARD_LAUNCH, BACKWARD_LAUNCH,
// DELTA_LAUNCH, CONVERT_LAUNCH) with LAUNCH_ABI; a caller built from these same headers casts them back to
// these types. Bump kLaunchAbi whenever ForwardArgs, BackwardArgs, DeltaArgs, ConvertArgs or these signatures
// change: the shim refuses modules of another ABI, and they are rebuilt (the headers are part of every module's
// cache key).
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "omnigen/backward_args.h"
#include "omnigen/forward_args.h"

namespace omnigen {

constexpr int kLaunchAbi = 6;

using ForwardLaunch = int (*)(const ForwardArgs&, uintptr_t, char*, int);
using BackwardLaunch = int (*)(const BackwardArgs&, uintptr_t, char*, int);
using DeltaLaunch = int (*)(const DeltaArgs&, uintptr_t, char*, int);
using ConvertLaunch = int (*)(const ConvertArgs&, uintptr_t, char*, int);

// What a launch's sizes must satisfy (grid dimensions, GQA, the scale): an empty string, or the sentence to raise.
inline std::string size_problem(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_len, int block_m,
                                double scale) {
  constexpr int64_t kMaxGridDim = 65535;  // a grid's y and z: heads, batch, the forward's q-tiles
  if (batch < 1 || batch > kMaxGridDim) return "batch must be between 1 and 65535, got " + std::to_string(batch);
  if (heads_q < 1 || heads_q > kMaxGridDim) {
    return "heads_q must be between 1 and 65535, got " + std::to_string(heads_q);
  }
  if (heads_kv < 1 || heads_q % heads_kv != 0) {
    return "heads_q (" + std::to_string(heads_q) + ") must be a multiple of heads_kv (" + std::to_string(heads_kv) +
           ")";
  }
  if (seq_len < 1) return "seq_len must be at least 1, got " + std::to_string(seq_len);
  if ((seq_len + block_m - 1) / block_m > kMaxGridDim) {
    return "seq_len " + std::to_string(seq_len) + " makes more than 65535 q-tiles of " + std::to_string(block_m) +
           " rows (a grid dimension holds 65535): use a larger block_m";
  }
  if (!std::isfinite(scale) || scale <= 0) return "scale must be a positive finite number, got " + std::to_string(scale);
  return "";
}

}  // namespace omnigen
