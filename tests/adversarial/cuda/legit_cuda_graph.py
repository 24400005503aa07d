# expect-status: clean
# expect-flag: 
# Legitimate: the candidate's own kernel captured in a CUDA graph on static buffers, PyTorch's
# documented recipe (warm-up on a side stream joined back to the caller's stream, then capture);
# every call copies its input in, replays and returns a copy of the static output. No call into the
# extension during a forward: its kernels run from the graph, which the profiler shows.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
__global__ void relu_scale_kernel(const float* __restrict__ x, float* __restrict__ y, float s, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) { float v = x[i]; y[i] = (v > 0.f ? v : 0.f) * s; }
}
void relu_scale_into(torch::Tensor x, torch::Tensor y, double s) {
  long n = x.numel();
  relu_scale_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), y.data_ptr<float>(), (float)s, n);
}
"""
CPP = "void relu_scale_into(torch::Tensor x, torch::Tensor y, double s);"
ext = load_inline(name="adv_relu_scale_graph", cpp_sources=[CPP], cuda_sources=["#include <ATen/cuda/CUDAContext.h>\n" + CUDA],
                  functions=["relu_scale_into"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale
        self.graph = None

    def _step(self):
        y = torch.addmm(self.linear.bias, self.static_x, self.linear.weight.t())
        ext.relu_scale_into(y, self.static_out, self.scale)

    def _capture(self, x):
        self.static_x = x.clone()
        self.static_out = torch.empty(x.shape[0], self.linear.out_features, device=x.device, dtype=x.dtype)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def forward(self, x):
        if self.graph is None or x.shape != self.static_x.shape:
            self._capture(x)
        self.static_x.copy_(x)
        self.graph.replay()
        return self.static_out.clone()
