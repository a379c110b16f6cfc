// hobbit-expert-store.cpp - reading experts: pread, or O_DIRECT in whole granules of the file
// system's alignment, from the part of a split model that holds each slice (the index of what
// lies where: hobbit-expert-index.cpp).

#include "hobbit-expert-store.h"

#include "hobbit-error.h"

#include "ggml.h"
#include "gguf.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string_view>
#include <unordered_map>

// O_DIRECT buffers are aligned to a page, and offsets and sizes to at most a page
static constexpr size_t DIRECT_IO_ALIGN = 4096;

// the granules O_DIRECT needs of this file's offsets and sizes, and of the memory it reads into:
// what its file system says (statx's dio_offset_align and dio_mem_align, Linux 6.1+: usually the
// device's logical block, 512 bytes on most disks), else a page. Why it matters: a neuron read is a
// run of a few 8.5 KB neurons, and rounding each to pages reads ~4 KB more per run (7 % of a missed
// expert on the tall model); at 512-byte granules a neuron layout's runs (aligned so) read only the
// neurons, straight into the row cache's pages (docs/BENCHMARKS.md at 5f63b2a, CORM's reads at the disk's granule)
static void file_direct_io_granules(int fd, uint64_t & offset_granule, uint64_t & memory_granule) {
    offset_granule = memory_granule = DIRECT_IO_ALIGN;
#if defined(__GLIBC__) && defined(STATX_DIOALIGN)
#if __GLIBC_PREREQ(2, 28) // statx's wrapper
    struct statx st;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) == 0 && (st.stx_mask & STATX_DIOALIGN) != 0) {
        const uint64_t g = st.stx_dio_offset_align, m = st.stx_dio_mem_align;
        if (g > 0 && (g & (g - 1)) == 0 && g <= DIRECT_IO_ALIGN && m > 0 && (m & (m - 1)) == 0 && m <= DIRECT_IO_ALIGN) {
            offset_granule = g;
            memory_granule = m;
        }
    }
#endif
#endif
    (void) fd;
}

expert_store::expert_store(const expert_index & index, bool direct_io, ggml_backend_buffer_type_t pinned,
                           uint64_t max_read)
        : index(index), pinned(pinned) {
    const auto close_all = [&] {
        for (const int f : fd) close(f);
        for (const int f : fd_direct) close(f);
    };
    for (const std::string & part : index.parts) {
        fd.push_back(open(part.c_str(), O_RDONLY | O_CLOEXEC));
        if (fd.back() < 0) {
            const std::string why = std::string(std::strerror(errno));
            fd.pop_back();
            close_all();
            throw hobbit_error(HOBBIT_STATUS_ERROR_IO, part + ": cannot open model file: " + why);
        }
    }
    max_slice = max_read > 0 ? max_read : (uint64_t) index.info.max_slice_bytes;
    if (direct_io) {
        for (const std::string & part : index.parts) {
            fd_direct.push_back(open(part.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
            if (fd_direct.back() < 0) {
                close_direct();  // one part refuses it: all buffered (the parts share a folder)
                break;
            }
            // the parts' granules: the coarsest (they are on one file system, so the same)
            uint64_t g = 0, m = 0;
            file_direct_io_granules(fd_direct.back(), g, m);
            granule = fd_direct.size() == 1 ? g : std::max(granule, g);
            memory_granule = fd_direct.size() == 1 ? m : std::max(memory_granule, m);
        }
        bounce_size = (max_slice + 2*DIRECT_IO_ALIGN + DIRECT_IO_ALIGN - 1) / DIRECT_IO_ALIGN * DIRECT_IO_ALIGN;
    }
    if (pinned != nullptr && !fd_direct.empty()) {
        // the O_DIRECT bounce buffer in page-locked memory (aligned inside it): read_slice
        // returns it, and the copy to the device is one DMA
        pinned_bounce_buf = ggml_backend_buft_alloc_buffer(pinned, bounce_size + DIRECT_IO_ALIGN);
        if (pinned_bounce_buf == nullptr) {
            close_all();
            throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, "cannot allocate " + std::to_string(bounce_size >> 20) +
                               " MB of page-locked memory to stage expert loads");
        }
        const uintptr_t base = (uintptr_t) ggml_backend_buffer_get_base(pinned_bounce_buf);
        bounce = (void *) ((base + DIRECT_IO_ALIGN - 1) / DIRECT_IO_ALIGN * DIRECT_IO_ALIGN);
    } else if (!fd_direct.empty() && posix_memalign(&bounce, DIRECT_IO_ALIGN, bounce_size) != 0) {
        bounce = nullptr;
        close_direct();
    }
}

expert_store::~expert_store() {
    for (const int f : fd) {
        close(f);
    }
    close_direct();
    if (pinned_bounce_buf != nullptr) {
        ggml_backend_buffer_free(pinned_bounce_buf); // bounce lives inside it
    } else {
        free(bounce);
    }
    if (pinned_staging_buf != nullptr) {
        ggml_backend_buffer_free(pinned_staging_buf);
    }
}

void expert_store::close_direct() {
    for (const int f : fd_direct) {
        close(f);
    }
    fd_direct.clear();
}

void expert_store::read_failed(int part, uint64_t offset, uint64_t n_bytes, ssize_t n) const {
    throw hobbit_error(HOBBIT_STATUS_ERROR_IO, index.parts[part] + ": read of " + std::to_string(n_bytes) + " bytes at offset " +
        std::to_string(offset) + " failed: " + (n < 0 ? std::string(std::strerror(errno)) : std::string("unexpected end of file")));
}

const void * expert_store::read_direct(int part, uint64_t offset, uint64_t n_bytes) {
    // O_DIRECT wants aligned offsets, sizes and buffers: read the span of whole granules
    // around the slice into the bounce buffer (a page-aligned buffer with a page either side
    // holds it: the granule is at most a page)
    const uint64_t beg = offset / granule * granule;
    const uint64_t end = (offset + n_bytes + granule - 1) / granule * granule;
    uint64_t done = 0;
    while (beg + done < offset + n_bytes) {
        const ssize_t n = pread(fd_direct[part], (char *) bounce + done, end - beg - done, beg + done);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0 && errno == EINVAL && done == 0 && granule < DIRECT_IO_ALIGN) {
            granule = memory_granule = DIRECT_IO_ALIGN; // the file system's granules were not enough after all: pages
            return read_direct(part, offset, n_bytes);
        }
        if (n < 0 && errno == EINVAL && done == 0) {
            // this file system does not do O_DIRECT after all: stay buffered
            close_direct();
            return nullptr;
        }
        if (n <= 0) {
            read_failed(part, offset, n_bytes, n);
        }
        done += n;
    }
    return (const char *) bounce + (offset - beg);
}

uint64_t expert_store::read_direct_to(int part, uint64_t offset, uint64_t n_bytes, void * dst) {
    uint64_t done = 0;
    while (done < n_bytes && done % granule == 0) { // a short read leaving an unaligned rest: the bounce finishes it
        const ssize_t n = pread(fd_direct[part], (char *) dst + done, n_bytes - done, offset + done);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0 && errno == EINVAL) {
            break; // the granules were not enough after all: the bounce path reads it
        }
        if (n <= 0) {
            read_failed(part, offset, n_bytes, n);
        }
        done += n;
    }
    return done;
}

void expert_store::read_at(int part, uint64_t offset, uint64_t n_bytes, void * dst) {
    uint64_t done = 0;
    // whole granules into memory aligned as O_DIRECT wants it (a neuron layout's runs into the row
    // cache's pages): straight from the disk, without the bounce buffer's copy
    if (!fd_direct.empty() && offset % granule == 0 && n_bytes % granule == 0 && (uintptr_t) dst % memory_granule == 0) {
        done = read_direct_to(part, offset, n_bytes, dst);
    }
    // the bounce buffer holds max_slice with an aligned block either side: longer reads go in parts
    while (!fd_direct.empty() && done < n_bytes) {
        const uint64_t n = std::min<uint64_t>(n_bytes - done, bounce_size - 2 * DIRECT_IO_ALIGN);
        const void * src = read_direct(part, offset + done, n);
        if (src == nullptr) {
            break; // no O_DIRECT here after all: the rest buffered
        }
        memcpy((char *) dst + done, src, n);
        done += n;
    }
    while (done < n_bytes) {
        const ssize_t n = pread(fd[part], (char *) dst + done, n_bytes - done, offset + done);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            read_failed(part, offset, n_bytes, n);
        }
        done += n;
    }
}

const void * expert_store::read_slice(int il, int e, int proj) {
    const expert_proj_layout & pl = index.layers.at(il).proj[proj];
    const uint64_t offset = pl.offset + (uint64_t) e * pl.n_bytes;
    if (pl.n_bytes > max_slice) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, index.path + ": projection " + std::to_string(proj) +
                           " is never read whole by this reader (a neuron layout's up, or a reader of rows), yet "
                           "it was asked for whole");
    }
    if (!fd_direct.empty()) {
        if (const void * src = read_direct(pl.part, offset, pl.n_bytes)) {
            return src;
        }
    }
    if (pinned != nullptr) {
        // buffered reads (no O_DIRECT here) stage in page-locked memory too, made at first use
        if (pinned_staging_buf == nullptr) {
            pinned_staging_buf = ggml_backend_buft_alloc_buffer(pinned, max_slice);
            if (pinned_staging_buf == nullptr) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, "cannot allocate " + std::to_string(max_slice >> 20) +
                                   " MB of page-locked memory to stage expert loads");
            }
        }
        void * dst = ggml_backend_buffer_get_base(pinned_staging_buf);
        read_at(pl.part, offset, pl.n_bytes, dst);
        return dst;
    }
    staging.resize(pl.n_bytes);
    read_at(pl.part, offset, pl.n_bytes, staging.data());
    return staging.data();
}

void expert_store::read_expert(int il, int e, void * const dst[LLAMA_MOE_PROJ_COUNT]) {
    const expert_layer_layout & layer = index.layers.at(il);
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const expert_proj_layout & pl = layer.proj[p];
        if (!pl.present || dst[p] == nullptr) {
            continue;
        }
        read_at(pl.part, pl.offset + (uint64_t) e * pl.n_bytes, pl.n_bytes, dst[p]);
    }
}

void expert_store::read_piece(int il, int e, int proj, uint64_t begin, uint64_t end, void * dst) {
    const expert_proj_layout & pl = index.layers.at(il).proj[proj];
    read_at(pl.part, pl.offset + (uint64_t) e * pl.n_bytes + begin, end - begin, dst);
}
