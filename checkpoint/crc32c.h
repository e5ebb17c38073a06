// crc32c (Castagnoli), the checksum of every checkpoint file's manifest and
// data: the SSE4.2 instruction where the CPU has it, a table elsewhere; both
// give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardopt::checkpoint {

// Extends `crc` (0 to start) over n bytes.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace shardopt::checkpoint
