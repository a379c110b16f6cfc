#include "hobbit-cache-policy.h"

namespace {

class lru_policy : public cache_policy_i {
public:
    explicit lru_policy(int n_slot) : last_use(n_slot, 0) {}

    void on_insert(int slot, int, int) override { last_use[slot] = ++clock; }
    void on_access(int slot) override { last_use[slot] = ++clock; }

    int choose_victim(const std::vector<int> & candidates) override {
        int best = candidates.front();
        for (int slot : candidates) {
            if (last_use[slot] < last_use[best]) {
                best = slot;
            }
        }
        return best;
    }

private:
    uint64_t clock = 0;
    std::vector<uint64_t> last_use; // clock of the last insert or access, per slot
};

} // namespace

std::unique_ptr<cache_policy_i> cache_policy_make_lru(int n_slot) {
    return std::make_unique<lru_policy>(n_slot);
}
