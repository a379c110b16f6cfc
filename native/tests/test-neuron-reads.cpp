// test-neuron-reads.cpp - native unit tests: neuron-granular reads.
#include "test-common.h"

#include "hobbit-neuron-reads.h"
#include "hobbit-neuron-rows.h"
#include "hobbit-expert-store.h"
#include "hobbit-io-scheduler.h"
#include "hobbit-error.h"

// CORM's neuron reads: the keep rule, the neuron row cache, the sparse up and down products
// over Q8_0 rows in pages, and ranged loads through the scheduler
void test_neuron_reads(const std::string & path) {
    // SiLU of these: -0.072, -0.048, 0, 0.026, 0.172, 0.731, 2.858, -0.189
    const float g[8] = { -4.0f, -0.1f, 0.0f, 0.05f, 0.3f, 1.0f, 3.0f, -0.5f };
    neuron_bits keep;
    CHECK(!neuron_keep(g, 8, 0.18f, 1.0f, keep) && keep.count() == 3 && keep.test(5) && keep.test(6) && keep.test(7));
    CHECK(neuron_keep(g, 8, 0.0f, 0.75f, keep) && keep.count() == 8); // every neuron passes: over the limit, whole

    // the row cache: rows read land in the lowest free pages, a run of neurons in a run of pages;
    // a hit reads only what it lacks; room comes from the least recently used owner outside the pass
    {
        neuron_row_cache rows(10, 100, 12, /*bridge*/ 1);
        neuron_rows_plan plan;
        std::vector<neuron_row_run> runs;
        CHECK(rows.plan_rows({ { 7, bits(10, { 0, 1, 2, 5 }) } }, plan) && plan.evict.empty());
        rows.apply_rows(plan, runs);
        CHECK(runs.size() == 2 && runs[0].first == 0 && runs[0].count == 3 && runs[0].first_page == 0 &&
              runs[1].first == 5 && runs[1].count == 1 && runs[1].first_page == 3);
        CHECK(rows.pages(7)[5] == 3 && rows.pages(7)[3] == -1 && rows.n_free() == 8 && rows.pages(8) == nullptr);
        CHECK(rows.plan_rows({ { 8, bits(10, { 0, 1, 2, 3, 4, 5 }) } }, plan) && plan.evict.empty());
        runs.clear();
        rows.apply_rows(plan, runs);
        CHECK(rows.n_free() == 2);
        // owner 7 again: only neuron 6 is read
        CHECK(rows.plan_rows({ { 7, bits(10, { 1, 5, 6 }) } }, plan) && plan.evict.empty() && plan.reads.size() == 1 &&
              plan.reads[0].second.count() == 1 && plan.reads[0].second.test(6));
        runs.clear();
        rows.apply_rows(plan, runs);
        // a third owner needing 5 rows: 8 (used before 7) goes, 7 stays
        CHECK(rows.plan_rows({ { 9, bits(10, { 0, 1, 2, 3, 4 }) } }, plan) && plan.evict == std::vector<int64_t>{ 8 });
        runs.clear();
        rows.apply_rows(plan, runs);
        CHECK(rows.pages(8) == nullptr && rows.pages(7) != nullptr && rows.n_free() == 12 - 5 - 5);
        CHECK(runs.size() == 1 && runs[0].first_page == 4 && runs[0].count == 5); // the pages 8 left
        // a one-row gap between two needed rows is read too (one request), unless it is held
        neuron_bits gap = bits(10, { 2, 4, 7, 9 });
        rows.bridge_gaps(gap, nullptr);
        CHECK(gap.count() == 6 && gap.test(3) && gap.test(8) && !gap.test(5) && !gap.test(6));
        const std::vector<int32_t> held = { -1, -1, -1, -1, -1, -1, -1, -1, 3, -1 };
        gap = bits(10, { 2, 4, 7, 9 });
        rows.bridge_gaps(gap, held.data());
        CHECK(gap.count() == 5 && gap.test(3) && !gap.test(8));
        // an expert that keeps no neuron reads nothing and holds nothing, now or after
        CHECK(rows.plan_rows({ { 5, neuron_bits(10) } }, plan) && plan.reads.empty());
        runs.clear();
        rows.apply_rows(plan, runs);
        CHECK(runs.empty() && rows.pages(5) == nullptr);
        CHECK(rows.plan_rows({ { 5, bits(10, { 4 }) } }, plan) && plan.reads.size() == 1);
        // a pass needing more than the pages: refused, nothing changed
        CHECK(!rows.plan_rows({ { 7, neuron_bits(10, true) }, { 9, neuron_bits(10, true) } }, plan));
        CHECK(rows.n_free() == 2);

        int n_gate = 0;
        int64_t n_page = 0;
        // 10 experts of a 300-byte gate and 2 x 3 rows of 100: the rows of 2 whole, the gates the rest
        CHECK(neuron_rows_split(10 * 900, 300, 3, 100, 2, 1000, n_gate, n_page) && n_gate == 26 && n_page == 6);
        // every gate held (n_max): the pages take the rest, up to n_max experts' rows
        CHECK(neuron_rows_split(10 * 900, 300, 3, 100, 2, 20, n_gate, n_page) && n_gate == 20 && n_page == 15);
        CHECK(neuron_rows_split(100 * 900, 300, 3, 100, 2, 20, n_gate, n_page) && n_gate == 20 && n_page == 60);
        CHECK(!neuron_rows_split(2 * 900 - 1, 300, 3, 100, 2, 1000, n_gate, n_page));
        CHECK(neuron_rows_split(2 * 900, 300, 3, 100, 2, 1000, n_gate, n_page) && n_gate == 2 && n_page == 6);
    }

    // the sparse down equals the sum of the kept rows, dequantized, times their activations
    const int n_embd = 64, n_ff = 5;
    std::vector<float> w((size_t) n_ff * n_embd);
    for (size_t i = 0; i < w.size(); ++i) {
        w[i] = std::sin(0.37f * (float) i) * (1.0f + (float) (i % 7));
    }
    const size_t row = ggml_row_size(GGML_TYPE_Q8_0, n_embd);
    std::vector<uint8_t> q(n_ff * row);
    ggml_quantize_chunk(GGML_TYPE_Q8_0, w.data(), q.data(), 0, n_ff, n_embd, nullptr);
    std::vector<float> deq(w.size());
    ggml_get_type_traits(GGML_TYPE_Q8_0)->to_float(q.data(), deq.data(), (int64_t) deq.size());
    const float act[n_ff] = { 0.5f, 0.0f, -2.0f, 0.0f, 1.25f };
    // the rows in pages (of two rows: these in the second) out of order; neuron 3 never read
    const int32_t pages[n_ff] = { 2, 0, 4, -1, 1 };
    const size_t page = 2 * row;
    std::vector<uint8_t> arena(n_ff * page, 0xff);
    uint8_t * base = arena.data() + row;
    for (int f = 0; f < n_ff; ++f) {
        if (pages[f] >= 0) {
            memcpy(base + pages[f] * page, q.data() + f * row, row);
        }
    }
    std::vector<float> out(n_embd, 99.0f);
    neuron_down_q8_0(base, page, pages, n_ff, act, out.data(), 0, 1); // two threads' shares of the blocks
    neuron_down_q8_0(base, page, pages, n_ff, act, out.data(), 1, 2);
    for (int j = 0; j < n_embd; ++j) {
        float ref = 0.0f;
        for (int f = 0; f < n_ff; ++f) {
            ref += act[f] * deq[(size_t) f * n_embd + j];
        }
        CHECK(std::fabs(out[j] - ref) <= 1e-5f * (1.0f + std::fabs(ref)));
    }
    // a neuron left out is never touched: its row may be anything (here NaN scales)
    memset(base + pages[1] * page, 0xff, row);
    std::vector<float> again(n_embd);
    neuron_down_q8_0(base, page, pages, n_ff, act, again.data(), 0, 2);
    CHECK(memcmp(again.data(), out.data(), n_embd * sizeof(float)) == 0);
    // the sparse up: each kept neuron's dequantized row times x, 0 for the others (neuron 1's row is NaN)
    std::vector<float> x(n_embd);
    for (int j = 0; j < n_embd; ++j) {
        x[j] = std::cos(0.11f * (float) j);
    }
    const float kept[n_ff] = { 1.0f, 0.0f, 1.0f, 0.0f, 1.0f };
    float up[n_ff];
    neuron_up_q8_0(base, page, pages, n_embd, x.data(), kept, up, 0, 2);
    neuron_up_q8_0(base, page, pages, n_embd, x.data(), kept, up, 2, n_ff);
    for (int f = 0; f < n_ff; ++f) {
        float ref = 0.0f;
        for (int j = 0; j < n_embd && kept[f] != 0.0f; ++j) {
            ref += deq[(size_t) f * n_embd + j] * x[j];
        }
        CHECK(std::fabs(up[f] - ref) <= 1e-4f * (1.0f + std::fabs(ref)));
    }

    // a load of ranges writes their bytes alone and reports their sum, read by the expert
    // readers or by row readers (a range longer than a row reader's buffer cut into several
    // reads: the model of 1024 neurons has 256 KB of up per expert)
    const std::string wide = write_model(path + ".wide", /*n_ff*/ 1024);
    for (const std::string & file : { path, wide }) {
        const expert_index idx = expert_index::from_file(file);
        const uint64_t n_up = idx.layers[0].proj[LLAMA_MOE_PROJ_UP].n_bytes;
        for (int n_row_readers : { 0, 3 }) {
            std::vector<uint8_t> buf(n_up, 0xab);
            const uint64_t a = 256, b = 520, c = n_up - 300; // [0, a) and [b, c)
            std::mutex mtx;
            std::condition_variable cv;
            uint64_t reported = 0;
            bool done = false;
            {
                io_scheduler io({ &idx }, /*direct_io*/ true, /*n_threads*/ 2,
                    [&](const load_task &, const std::string & err, uint64_t n, int64_t) {
                        CHECK(err.empty());
                        std::lock_guard<std::mutex> lock(mtx);
                        reported = n;
                        done = true;
                        cv.notify_all();
                    }, nullptr, n_row_readers);
                load_task t = { 0, 0, 0, /*layer*/ 0, /*expert*/ 1, /*prefetch*/ false, {}, {}, {} };
                t.ranges = { { LLAMA_MOE_PROJ_UP, 0, a, buf.data() }, { LLAMA_MOE_PROJ_UP, b, c, buf.data() + b } };
                io.submit({ t });
                std::unique_lock<std::mutex> lock(mtx);
                cv.wait(lock, [&] { return done; });
            }
            CHECK(reported == a + (c - b));
            CHECK(file == path || c - b > 2 * HOBBIT_ROW_READ_BYTES);
            for (uint64_t i = 0; i < n_up; ++i) {
                const bool in = i < a || (i >= b && i < c);
                CHECK(buf[i] == (in ? pattern(0, LLAMA_MOE_PROJ_UP, 1, i) : 0xab));
            }
        }
    }
    unlink(wide.c_str());
    printf("ok neuron reads\n");
}
