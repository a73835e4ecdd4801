// Built when KVQ_BUILD_CUDA is OFF: the CUDA backend reports "not supported".
#include "kvq/cuda.h"

#include "kvq/error.h"

namespace kvq::cuda {

bool available() { return false; }
std::string device_name() { return "none (kvq built without CUDA)"; }
void require() { fail_unsupported("[cuda] not supported: kvq was built without KVQ_BUILD_CUDA"); }

}  // namespace kvq::cuda
