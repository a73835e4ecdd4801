// Paging a GGUF file's tensor data in up front (kvq server, issue 16).
#pragma once
#include <cstddef>

#include "kvq/gguf.h"

namespace kvq {

// Maps every page of f's tensor data into this process now (madvise MADV_WILLNEED, then a read of
// one byte a page) instead of page by page as the tensors are first read. kvq server calls it
// before it listens so that its resident memory holds the weights from the start: otherwise the
// first forward pages in most of the file (347 MiB of Qwen2.5-Coder-0.5B Q4_K_M's 469 MiB) and the
// token embedding's rows follow as new tokens arrive, which reads as RSS growing under load
// (docs/server.md, "Memory"). The pages stay clean file pages that the kernel may still drop under
// memory pressure. Returns the bytes of the range touched: from the first tensor's data to the end
// of the last one (0 without tensors).
size_t gguf_prefault(const gguf_file& f);

}  // namespace kvq
