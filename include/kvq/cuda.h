// CUDA backend entry points. Without KVQ_BUILD_CUDA every function exists and reports
// "not supported" (MLX's no_gpu pattern).
#pragma once
#include <string>

namespace kvq::cuda {

bool available();           // built with CUDA and a GPU is visible
std::string device_name();  // e.g. "NVIDIA H200 (sm_90)"
void require();             // throws kvq::error(unsupported) unless available()

}  // namespace kvq::cuda
