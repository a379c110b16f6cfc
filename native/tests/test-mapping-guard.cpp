// test-mapping-guard.cpp - native unit tests: the mapping guard's SIGBUS catch.
#include "test-common.h"

#include "hobbit-mapping-guard.h"

// a file mapped, then cut: a read past its new end inside a guard reads zeros and marks the
// guard, where it would have been a SIGBUS
void test_mapping_guard(const std::string & dir) {
    const std::string path = dir + "/hobbit-guard-test-" + std::to_string(getpid());
    const long page = sysconf(_SC_PAGESIZE);
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(fd >= 0);
    std::vector<char> ones(3 * page, 1);
    CHECK(write(fd, ones.data(), ones.size()) == (ssize_t) ones.size());
    auto * map = (volatile const char *) mmap(nullptr, 3 * page, PROT_READ, MAP_SHARED, fd, 0);
    CHECK(map != MAP_FAILED);
    {
        mapping_guard guard((const void *) map, 3 * page);
        CHECK(map[2 * page] == 1 && !guard.faulted());
        CHECK(ftruncate(fd, page) == 0);
        CHECK(map[0] == 1 && !guard.faulted());  // still in the file
        CHECK(map[2 * page + 5] == 0);           // past the end: zeros, no signal
        CHECK(guard.faulted());
        // the file whole again: restore maps it back over the zero page
        CHECK(pwrite(fd, ones.data(), ones.size(), 0) == (ssize_t) ones.size());
        CHECK(guard.restore(fd, 0, MADV_RANDOM) && !guard.faulted());
        CHECK(map[2 * page + 5] == 1 && map[0] == 1 && !guard.faulted());
        // and again, on another page: each restore maps back the pages of its own faults
        CHECK(ftruncate(fd, 0) == 0);
        CHECK(map[page] == 0 && guard.faulted());
        CHECK(pwrite(fd, ones.data(), ones.size(), 0) == (ssize_t) ones.size());
        CHECK(guard.restore(fd, 0, MADV_RANDOM) && !guard.faulted());
        CHECK(map[page] == 1 && map[2 * page] == 1 && !guard.faulted());
    }
    munmap((void *) map, 3 * page);
    close(fd);
    unlink(path.c_str());
    printf("mapping guard: ok\n");
}
