// hobbit-model-files.h - the model's files as one run holds them: each part open for the run, its
// mapping guarded against SIGBUS and advised to read no further than a fault's page, and the checks
// that a file was not cut or replaced while running; read-ahead of experts computed in place.
//
// Its checks return what went wrong (empty: nothing), which the runtime makes the run's failure.
#pragma once

#include "hobbit-expert-store.h"
#include "hobbit-mapping-guard.h"

#include "llama.h"

#include <sys/types.h>

#include <ctime>
#include <memory>
#include <string>
#include <vector>

class model_files {
public:
    // model: the loaded model whose expert tensors map the files (nullptr: none, nothing to open)
    explicit model_files(const llama_model * model) : model_(model) {}
    ~model_files();
    model_files(const model_files &) = delete;
    model_files & operator=(const model_files &) = delete;

    const llama_model * model() const { return model_; }
    // the model's mappings of index's parts (its expert tensors of moe_layers) advised and guarded,
    // every part opened; throws hobbit_error when one cannot be
    void open(const expert_index & index, const std::vector<int> & moe_layers);

    // before a ubatch: what changed in a file since load (cut, written to, overwritten), or empty
    std::string changed() const;
    // whether a file still holds expert e of layer il (computing it in place would fault on pages
    // past the end of a cut file): what is wrong, or empty
    std::string expert_missing(int il, int e) const;
    bool faulted() const;            // a guard caught a SIGBUS in a mapped part
    std::string fault() const;       // which part, said, or empty
    // a fault left zero pages in a mapping: the file's own pages again
    void restore();

    // expert e of layer il computes in place: its slices are read ahead, exactly
    void read_ahead_expert(int il, int e) const;
    // a layer's whole experts read into the page cache (asynchronous)
    void read_ahead_layer(int il) const;

private:
    struct part_file {
        int             fd = -1;
        off_t           size = 0;     // when last found unchanged
        struct timespec mtime = {};
        std::unique_ptr<mapping_guard> guard; // over the part's whole mapping (none when it is not mapped)
    };
    // where each part's mapping starts (0: not one mapping of the file): the offloaded experts are
    // mapped MADV_RANDOM from here
    std::vector<uintptr_t> advise_random(const std::vector<int> & moe_layers) const;
    void close_all();

    const expert_index * index = nullptr;
    const llama_model *  model_ = nullptr;
    std::vector<part_file> parts;
    std::string loaded_fingerprint; // of the experts as loaded (expert_index::fingerprint)
};
