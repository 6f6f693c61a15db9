// omnigen primitive: shared memory -> mma fragments (ldmatrix, sm_75+).
// Each lane passes the address of one 16-byte row; lanes 8i..8i+7 address matrix i.
#pragma once
#include <cstdint>

#include "omnigen/sm80/cp_async.cuh"  // shared_address

namespace omnigen {

// Addresses are 32-bit shared-space byte addresses (see shared_address): half the registers of a
// generic pointer, and a compile-time offset added to one folds into the instruction.

// Four 8x8 b16 matrices; lane t receives row t/4, columns 2*(t%4) and +1 of each.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&fragment)[4], uint32_t row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(row_address));
}

// The same four matrices transposed: lane t receives column t/4, rows 2*(t%4) and +1 of each.
// Turns a row-major [k][n] tile (V as stored) into the column-major B operand mma wants.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&fragment)[4], uint32_t row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(row_address));
}

}  // namespace omnigen
