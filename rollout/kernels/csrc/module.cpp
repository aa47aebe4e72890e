// The Python bindings of rollout's CPU kernels (rollout/kernels/cpu_kernels.py builds this file with the others).
//
// Every entry point releases the GIL: the arguments are converted first, and no Python object is
// touched inside (the caller's other Python threads run during the call).

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged cache (CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("table"), py::arg("row"), py::arg("start"), py::arg("end"),
        py::arg("page_size"), py::arg("scale"), py::arg("softcap"), py::arg("out"), py::arg("alias") = py::none(),
        release());
  m.def("cascade_decode_attention", &cascade_decode_attention,
        "decode attention over the paged cache, shared pages read once per group of rows (CPU)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("table"), py::arg("row"), py::arg("start"), py::arg("end"),
        py::arg("page_size"), py::arg("scale"), py::arg("softcap"), py::arg("out"), py::arg("alias") = py::none(),
        release());
  m.def("cascade_plan", &cascade_plan, "the cascade groups of a step (tests)", py::arg("table"), py::arg("row"),
        py::arg("start"), py::arg("end"), py::arg("page_size"), py::arg("alias") = py::none(), release());
  m.def("parallel_threads", &parallel_threads, "threads an at::parallel_for runs on (tests)", release());
  m.def("small_gemm_available", &small_gemm_available, "whether small_linear runs in this build (AVX-512)");
  m.def("pack_panels", &pack_panels, "a [N, K] fp32 weight as small_linear's panels [ceil(N/16), K, 16]",
        release());
  m.def("small_linear", &small_linear, "x [M, K] @ W^T + bias for a few rows (decode), W as pack_panels(W)",
        release());
  m.def("small_linears", &small_linears, "[x @ W_i^T + bias_i] for several weights of one input (q / k / v, gate / up)",
        release());
  m.def("qk_norm_rope", &qk_norm_rope,
        "the query and key heads RMS-normed (optional weights) and rotated (RoPE), as Llama-family attention does",
        release());
  m.def("rms_norm", &rms_norm, "weight * (x * rsqrt(mean(x^2, -1) + eps)) for fp32 CPU tensors (Llama's RMSNorm)",
        release());
  m.def("write_kv", &write_kv, "a step's keys and values into the paged caches [Hkv, S, D] at slots (CPU)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up for fp32 CPU tensors (the gated MLP's activation)", release());
  m.def("argmax_rows", &argmax_rows, "each row's argmax of a fp32 [R, V] CPU tensor, as torch's argmax(dim=-1)",
        release());
  m.def("greedy_verify", &greedy_verify,
        "a greedy speculative step's verification: each row's argmax position after position until a draft is "
        "rejected, and each emitted position's log-softmax", py::arg("logits"), py::arg("lens"), py::arg("drafts"),
        py::arg("logprobs"), release());
  m.def("decoder_layer", &decoder_layer,
        "one Llama-family decoder layer of decode rows: the norms, linears, RoPE, KV write and paged attention "
        "kernels in the Python path's order (same bits)", release());
  bind_suffix_drafts(m);
}
