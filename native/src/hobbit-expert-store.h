// hobbit-expert-store.h - where every routed expert lives in the GGUF file (or the files of a
// split model), and reading one into memory.
//
// Experts are stacked per projection (blk.N.ffn_{gate,up,down,gate_up}_exps.weight,
// [n_in, n_out, n_expert]); expert e of layer N is one contiguous slice of each, so a
// load is one read per projection. A split model (llama.cpp's gguf-split, NAME-00001-of-0000N.gguf)
// is indexed from its first file: the metadata is there, the tensors anywhere among the parts.
#pragma once

#include "hobbit.h"

#include "ggml-backend.h"
#include "llama.h"

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

struct expert_proj_layout {
    bool     present = false;
    int      type    = -1;      // ggml_type
    int64_t  ne[3]   = {0, 0, 0}; // n_in, n_out, n_expert
    int      part    = 0;       // the file it lives in (expert_index::parts)
    uint64_t offset  = 0;       // offset of expert 0 in that file
    uint64_t n_bytes = 0;       // bytes of one expert's slice
};

struct expert_layer_layout {
    expert_proj_layout proj[LLAMA_MOE_PROJ_COUNT];
    bool has_experts() const;
    bool same_signature(const expert_layer_layout & other) const; // same projections, types and shapes
    uint64_t n_bytes() const;   // one expert, all projections
};

// the index of a model's experts, built from the GGUF header only
struct expert_index {
    std::string path;               // the model as given: its only file, or the first part of a split model
    std::vector<std::string> parts; // every file, parts[0] == path (info.n_split of them)
    hobbit_model_info info = {};
    std::vector<expert_layer_layout> layers; // [n_layer]

    // a companion written by `hobbitpy prepare` records the model it was made of: its file
    // name and its fingerprint (empty for other files)
    std::string made_of;
    std::string made_of_fingerprint;

    // a companion written by `hobbitpy prepare --neuron-layout` (hobbitpy.companion.neuron_layout):
    // each expert's up tensor bundles the up rows and the transposed down, [n_embd, 2 x n_ff,
    // n_expert]: row 2f neuron f's up row, row 2f + 1 its down column; there is no down tensor.
    // A run of neurons is one read (CORM's neuron-granular reads)
    bool neuron_layout = false;

    // throws hobbit_error naming the file and what is wrong
    static expert_index from_file(const std::string & path);

    // identifies the experts' weights, not only their shapes: FNV-1a 64 of the first and last
    // 4 KB of every expert tensor, as 16 hex digits (a few reads; two models of the same
    // shapes differ in it). Throws hobbit_error on a failed read.
    std::string fingerprint() const;
    // the same of the files open as fds (one per part, in order): what they hold now
    std::string fingerprint_of(const std::vector<int> & fds) const;

    // a companion file (the same experts at another precision) must describe the same
    // model: architecture, sizes, and every expert tensor with the same name and shape
    // (types may differ), and, when the companion records the model it was made of, this
    // model's fingerprint; throws hobbit_error naming both files and the difference
    void check_companion(const expert_index & companion) const;

    mutable std::string fingerprint_cache; // fingerprint(), computed once: every companion of a run checks it
};

// reads expert slices from the file; one instance per reading thread
class expert_store {
public:
    // direct_io: try O_DIRECT; falls back to buffered reads where the file system refuses it.
    // pinned: a device's host buffer type (page-locked memory) for the buffers read_slice
    // returns, when the slices go on to device memory (one DMA each); NULL: plain memory.
    // max_read: the most its buffer holds (a reader of neuron rows: longer reads go in parts,
    // read_slice refuses any longer slice); 0: the largest slice read whole (info.max_slice_bytes)
    expert_store(const expert_index & index, bool direct_io, ggml_backend_buffer_type_t pinned = nullptr,
                 uint64_t max_read = 0);
    ~expert_store();
    expert_store(const expert_store &) = delete;
    expert_store & operator=(const expert_store &) = delete;

    // read every projection of expert e of layer il into dst[proj] (NULL = skip the projection).
    // Blocking. Throws hobbit_error on a failed or short read.
    void read_expert(int il, int e, void * const dst[LLAMA_MOE_PROJ_COUNT]);

    // read bytes [begin, end) of projection proj of expert e of layer il to dst (a piece of a
    // load, so that several threads can share one expert). Blocking; throws like read_expert.
    void read_piece(int il, int e, int proj, uint64_t begin, uint64_t end, void * dst);

    // read one projection's slice into a buffer of the store; the pointer is valid until
    // the next read. Blocking; throws like read_expert.
    const void * read_slice(int il, int e, int proj);

    bool direct_io() const { return !fd_direct.empty(); }
    // O_DIRECT's granule of offsets and sizes for this file: a read covers the whole granules around it
    uint64_t direct_io_granule() const { return granule; }

private:
    void read_at(int part, uint64_t offset, uint64_t n_bytes, void * dst);
    // O_DIRECT read of the aligned span around [offset, offset + n_bytes) into bounce;
    // returns where the requested bytes start, or NULL if O_DIRECT turned out unsupported
    const void * read_direct(int part, uint64_t offset, uint64_t n_bytes);
    // O_DIRECT read of whole granules straight into dst (aligned to memory_granule); returns how
    // many bytes it read, less than n_bytes where O_DIRECT refused or a short read left an unaligned rest
    uint64_t read_direct_to(int part, uint64_t offset, uint64_t n_bytes, void * dst);
    // a failed or short read of a part, as an error naming its file
    [[noreturn]] void read_failed(int part, uint64_t offset, uint64_t n_bytes, ssize_t n) const;
    void close_direct();  // O_DIRECT turned out unsupported: every part buffered from here

    const expert_index & index;
    std::vector<int> fd;         // buffered, one per part
    std::vector<int> fd_direct;  // O_DIRECT, one per part; empty when not in use
    void * bounce   = nullptr; // aligned buffer for O_DIRECT reads
    uint64_t granule = 4096;        // O_DIRECT's alignment of offsets and sizes for this file (at most a page)
    uint64_t memory_granule = 4096; // ... and of the memory it reads into
    size_t bounce_size = 0;
    std::vector<uint8_t> staging; // read_slice's buffer for buffered reads
    uint64_t max_slice = 0;       // the largest projection slice read whole (info.max_slice_bytes, or max_read)
    ggml_backend_buffer_type_t pinned = nullptr;        // page-locked memory, when loads go on to a device
    ggml_backend_buffer_t pinned_bounce_buf  = nullptr; // holds bounce, when pinned
    ggml_backend_buffer_t pinned_staging_buf = nullptr; // read_slice's buffer for buffered reads, when pinned
};
