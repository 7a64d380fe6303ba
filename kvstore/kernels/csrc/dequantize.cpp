// The codecs' decode on the CPU (cpu_ext.py builds it; kvstore/kernels/__init__.py's
// dequantize_int8/fp8 and kvstore/codecs/int4.py call it). dequantize: the int8 and fp8 rows.
//
// out[b, r, :] = value(data[b, r, :]) * scales[b, r], the product formed in float32 and rounded
// once to out's dtype (float32, float16 or bfloat16, rounding to nearest even): bit for bit what
// kernels/reference.py computes. value() is the int8 itself, or for float8 e4m3fn the byte moved
// into float16 bits (its value times 2**-8, exactly), with the scale times 256. One pass: each
// byte is read once and each value written once, with no float32 temporary in memory (the torch
// path writes and reads one of four bytes per value). Rows are spread over torch's intra-op
// threads.
//
// dequantize_int4 decodes the int4 codecs' rows: codes two a byte (code 2i in the low nibble of
// byte i), (c - 7.5) * s with one float16 scale per GROUP values of a row, formed in float32 as
// the torch path does; for int4-rot then the rotation undone. At a power-of-two head dim the
// rotation is the Hadamard matrix over sqrt(head_dim), undone with the fast Walsh-Hadamard
// transform (head_dim log2(head_dim) additions a row instead of head_dim**2 products; the same
// values up to float32 rounding, which differs from a matrix product's by about 1e-7 of a row).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define KVSTORE_DEQUANT_AVX2 1
#endif

namespace {

constexpr int64_t kGrainValues = 1 << 16;  // values per task: small calls stay on one thread

template <bool kFp8>
inline float value(uint8_t q) {
  if constexpr (kFp8) {
    // the byte sign-extended to 16 bits, shifted into float16's exponent and mantissa, bit 14 cleared
    uint16_t bits = static_cast<uint16_t>(static_cast<uint16_t>(static_cast<int16_t>(static_cast<int8_t>(q))) << 7);
    return c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(bits & 0xBFFF));
  } else {
    return static_cast<float>(static_cast<int8_t>(q));
  }
}

#ifdef KVSTORE_DEQUANT_AVX2
template <bool kFp8>
inline __m256 load8(const uint8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (kFp8) {
    __m128i bits = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7), _mm_set1_epi16(~0x4000));
    return _mm256_cvtph_ps(bits);
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
}

inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }

inline void store8(c10::Half* o, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline void store8(c10::BFloat16* o, __m256 v) {
  // round to nearest even on the upper 16 bits; NaN becomes torch's quiet NaN (0x7FC0)
  __m256i u = _mm256_castps_si256(v);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan), 16);
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
}
#endif

constexpr int64_t kGroup = 64;  // values an int4 scale covers (kvstore/codecs/int4.py GROUP)
constexpr int64_t kMaxDim = 1024;

template <typename O>
inline void store_row(O* dst, const float* y, int64_t dim) {
  int64_t d = 0;
#ifdef KVSTORE_DEQUANT_AVX2
  for (; d + 8 <= dim; d += 8) store8(dst + d, _mm256_loadu_ps(y + d));
#endif
  for (; d < dim; ++d) dst[d] = static_cast<O>(y[d]);
}

// y <- y H (Sylvester's Hadamard matrix, unnormalized), dim a power of two. kDim > 0 fixes the
// dim at compile time (the loops unroll and the row stays in registers); 0 reads it from dim.
template <int64_t kDim>
inline void walsh_hadamard(float* y, int64_t runtime_dim) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  int64_t h = 1;
#ifdef KVSTORE_DEQUANT_AVX2
  if (dim >= 8) {
    // the butterflies within each 8-value vector: t +/- v, partner lanes swapped into t
    const __m256 sign1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 sign2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 sign4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    for (int64_t j = 0; j < dim; j += 8) {
      __m256 v = _mm256_loadu_ps(y + j);
      v = _mm256_add_ps(_mm256_mul_ps(v, sign1), _mm256_permute_ps(v, 0xB1));
      v = _mm256_add_ps(_mm256_mul_ps(v, sign2), _mm256_permute_ps(v, 0x4E));
      v = _mm256_add_ps(_mm256_mul_ps(v, sign4), _mm256_permute2f128_ps(v, v, 1));
      _mm256_storeu_ps(y + j, v);
    }
    for (h = 8; h < dim; h *= 2) {
      for (int64_t i = 0; i < dim; i += 2 * h) {
        for (int64_t j = i; j < i + h; j += 8) {
          __m256 a = _mm256_loadu_ps(y + j), b = _mm256_loadu_ps(y + j + h);
          _mm256_storeu_ps(y + j, _mm256_add_ps(a, b));
          _mm256_storeu_ps(y + j + h, _mm256_sub_ps(a, b));
        }
      }
    }
    return;
  }
#endif
  for (; h < dim; h *= 2) {
    for (int64_t i = 0; i < dim; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = y[j], b = y[j + h];
        y[j] = a + b;
        y[j + h] = a - b;
      }
    }
  }
}

// one row's codes (dim of them, starting on a byte: dim even) times their groups' scales
inline void unpack_row(const uint8_t* codes, const c10::Half* scales, float* y, int64_t dim) {
  int64_t d = 0;
#ifdef KVSTORE_DEQUANT_AVX2
  const __m256 half_levels = _mm256_set1_ps(7.5f);
  for (; d + 16 <= dim && (d % kGroup) + 16 <= kGroup; d += 16) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d / 2));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    const __m128i ordered = _mm_unpacklo_epi8(low, high);  // codes d .. d + 15
    const __m256 scale = _mm256_set1_ps(static_cast<float>(scales[d / kGroup]));
    const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ordered));
    const __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(ordered, 8)));
    _mm256_storeu_ps(y + d, _mm256_mul_ps(_mm256_sub_ps(first, half_levels), scale));
    _mm256_storeu_ps(y + d + 8, _mm256_mul_ps(_mm256_sub_ps(second, half_levels), scale));
  }
#endif
  for (; d < dim; ++d) {
    const int code = (codes[d / 2] >> (4 * (d % 2))) & 0x0F;
    y[d] = (static_cast<float>(code) - 7.5f) * static_cast<float>(scales[d / kGroup]);
  }
}

template <typename O>
void dequantize_int4_rows(const torch::Tensor& packed, const torch::Tensor& scales, torch::Tensor& out,
                          bool hadamard) {
  const int64_t rows_per_block = out.size(1), dim = out.size(2);
  const int64_t num_rows = out.size(0) * rows_per_block;
  const auto* p = packed.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<c10::Half>();
  auto* o = out.data_ptr<O>();
  const int64_t pb = packed.stride(0), sb = scales.stride(0), sr = scales.stride(1);
  const int64_t ob = out.stride(0), orow = out.stride(1);
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
  const int64_t grain = std::max<int64_t>(1, kGrainValues / dim);
  auto rows = [&](auto fixed_dim) {
    constexpr int64_t kDim = decltype(fixed_dim)::value;
    at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
      alignas(64) float y[kMaxDim];
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / rows_per_block, r = i % rows_per_block;
        unpack_row(p + b * pb + r * dim / 2, s + b * sb + r * sr, y, kDim > 0 ? kDim : dim);
        if (hadamard) {
          walsh_hadamard<kDim>(y, dim);
          for (int64_t d = 0; d < (kDim > 0 ? kDim : dim); ++d) y[d] *= norm;
        }
        store_row(o + b * ob + r * orow, y, kDim > 0 ? kDim : dim);
      }
    });
  };
  if (dim == 64) return rows(std::integral_constant<int64_t, 64>{});
  if (dim == 128) return rows(std::integral_constant<int64_t, 128>{});
  rows(std::integral_constant<int64_t, 0>{});
}

template <bool kFp8, typename S, typename O>
void dequantize_rows(const torch::Tensor& data, const torch::Tensor& scales, torch::Tensor& out) {
  const int64_t rows_per_block = data.size(1), dim = data.size(2);
  const int64_t num_rows = data.size(0) * rows_per_block;
  const auto* q = data.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<S>();
  auto* o = out.data_ptr<O>();
  const int64_t qb = data.stride(0), qr = data.stride(1), sb = scales.stride(0), sr = scales.stride(1);
  const int64_t ob = out.stride(0), orow = out.stride(1);
  const int64_t grain = std::max<int64_t>(1, kGrainValues / std::max<int64_t>(dim, 1));
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / rows_per_block, r = i % rows_per_block;
      float scale = static_cast<float>(s[b * sb + r * sr]);
      if constexpr (kFp8) scale *= 256.0f;
      const uint8_t* src = q + b * qb + r * qr;
      O* dst = o + b * ob + r * orow;
      int64_t d = 0;
#ifdef KVSTORE_DEQUANT_AVX2
      const __m256 column = _mm256_set1_ps(scale);
      for (; d + 8 <= dim; d += 8) store8(dst + d, _mm256_mul_ps(load8<kFp8>(src + d), column));
#endif
      for (; d < dim; ++d) dst[d] = static_cast<O>(value<kFp8>(src[d]) * scale);
    }
  });
}

template <bool kFp8, typename S>
void dispatch_out(const torch::Tensor& data, const torch::Tensor& scales, torch::Tensor& out) {
  switch (out.scalar_type()) {
    case torch::kFloat32: return dequantize_rows<kFp8, S, float>(data, scales, out);
    case torch::kFloat16: return dequantize_rows<kFp8, S, c10::Half>(data, scales, out);
    case torch::kBFloat16: return dequantize_rows<kFp8, S, c10::BFloat16>(data, scales, out);
    default: TORCH_CHECK(false, "out must be float32, float16 or bfloat16, got ", out.scalar_type());
  }
}

template <bool kFp8>
void dispatch_scales(const torch::Tensor& data, const torch::Tensor& scales, torch::Tensor& out) {
  if (scales.scalar_type() == torch::kFloat16) return dispatch_out<kFp8, c10::Half>(data, scales, out);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "scales must be float16 or float32, got ",
              scales.scalar_type());
  dispatch_out<kFp8, float>(data, scales, out);
}

}  // namespace

namespace kvstore {

// data: uint8 [n, rows, head_dim] (int8 or e4m3fn bytes); scales: float16/float32 [n, rows];
// out: float32/float16/bfloat16 like data. Any strides, but head_dim contiguous.
void dequantize(torch::Tensor data, torch::Tensor scales, torch::Tensor out, bool fp8) {
  TORCH_CHECK(data.dim() == 3 && data.scalar_type() == torch::kUInt8, "data must be uint8 [n, rows, head_dim], got ",
              data.scalar_type(), " ", data.sizes());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == data.size(0) && scales.size(1) == data.size(1),
              "scales must be [n, rows] = [", data.size(0), ", ", data.size(1), "], got ", scales.sizes());
  TORCH_CHECK(out.sizes() == data.sizes(), "out must be ", data.sizes(), ", got ", out.sizes());
  TORCH_CHECK(data.device().is_cpu() && scales.device().is_cpu() && out.device().is_cpu(),
              "data, scales and out must be on the CPU");
  TORCH_CHECK((data.size(2) <= 1 || data.stride(2) == 1) && (out.size(2) <= 1 || out.stride(2) == 1),
              "data and out must be contiguous in head_dim, got strides ", data.strides(), " and ", out.strides());
  if (data.numel() == 0) return;
  if (fp8) {
    dispatch_scales<true>(data, scales, out);
  } else {
    dispatch_scales<false>(data, scales, out);
  }
}

// packed: uint8 [n, >= rows * head_dim / 2] (rows contiguous); scales: float16 [n, rows, groups];
// out: float32/float16/bfloat16 [n, rows, head_dim], head_dim even and at most 1024, contiguous
// rows. hadamard: undo int4-rot's rotation (head_dim a power of two).
void dequantize_int4(torch::Tensor packed, torch::Tensor scales, torch::Tensor out, bool hadamard) {
  TORCH_CHECK(out.dim() == 3 && out.size(2) % 2 == 0 && out.size(2) >= 2 && out.size(2) <= kMaxDim &&
                  out.stride(2) == 1,
              "out must be [n, rows, head_dim] with an even head_dim of at most ", kMaxDim, ", contiguous, got ",
              out.sizes(), " strides ", out.strides());
  const int64_t n = out.size(0), rows = out.size(1), dim = out.size(2);
  TORCH_CHECK(!hadamard || (dim & (dim - 1)) == 0, "the Hadamard rotation needs a power-of-two head_dim, got ", dim);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.size(0) == n &&
                  packed.size(1) >= rows * dim / 2 && packed.stride(1) == 1,
              "packed must be uint8 [", n, ", ", rows * dim / 2, "] with contiguous rows, got ", packed.scalar_type(),
              " ", packed.sizes());
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == torch::kFloat16 && scales.size(0) == n &&
                  scales.size(1) == rows && scales.size(2) == (dim + kGroup - 1) / kGroup && scales.stride(2) == 1,
              "scales must be float16 [", n, ", ", rows, ", ", (dim + kGroup - 1) / kGroup, "], got ",
              scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu() && out.device().is_cpu(),
              "packed, scales and out must be on the CPU");
  if (out.numel() == 0) return;
  switch (out.scalar_type()) {
    case torch::kFloat32: return dequantize_int4_rows<float>(packed, scales, out, hadamard);
    case torch::kFloat16: return dequantize_int4_rows<c10::Half>(packed, scales, out, hadamard);
    case torch::kBFloat16: return dequantize_int4_rows<c10::BFloat16>(packed, scales, out, hadamard);
    default: TORCH_CHECK(false, "out must be float32, float16 or bfloat16, got ", out.scalar_type());
  }
}

}  // namespace kvstore
