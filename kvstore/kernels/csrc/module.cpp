// The Python module of kvstore's CPU kernels (kvstore/kernels/cpu_ext.py builds it from every
// source in this directory). Each call releases the GIL.
#include <torch/extension.h>

namespace kvstore {
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor own_rows,
                            torch::Tensor own_lens, torch::Tensor members, torch::Tensor counts,
                            torch::Tensor shared_rows, torch::Tensor shared_lens, double scale);
void dequantize(torch::Tensor data, torch::Tensor scales, torch::Tensor out, bool fp8);
void dequantize_int4(torch::Tensor packed, torch::Tensor scales, torch::Tensor out, bool hadamard);
}  // namespace kvstore

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_attention", &kvstore::row_attention, "decode attention over KV rows read in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize", &kvstore::dequantize, "8-bit rows times one scale per row, rounded once into out",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_int4", &kvstore::dequantize_int4, "int4 codes times their group scales, rotation undone",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
