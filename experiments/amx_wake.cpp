// How long the first AMX tile product waits after the tile unit has been idle, and what loading a tile configuration
// costs: the numbers behind csrc_avx2/attend_amx.cpp's throwaway product at the top of a call and its kept
// configuration. One thread; a chain of the attention's shape (two query tiles, 16 keys x 32 values twice, the
// products, the store, a read of the result) after ALU work of a given length, with and without a throwaway product
// ~400 cycles before it; then the chain back to back with the configuration loaded every time, released every time,
// or read back and compared. TSC cycles and nanoseconds; run it alone.
//
//     g++ -O2 -o /tmp/amx_wake experiments/amx_wake.cpp && /tmp/amx_wake
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

alignas(64) uint16_t keys[16 * 64];
alignas(64) uint32_t queries[2 * 16 * 4];
alignas(64) float scores[16 * 4];
volatile float sink;

__attribute__((target("amx-tile,amx-bf16"))) static void chain() {
  _tile_loadd(2, queries, 16);
  _tile_loadd(3, queries + 64, 16);
  _tile_zero(0);
  _tile_loadd(1, keys, 128);
  _tile_dpbf16ps(0, 1, 2);
  _tile_loadd(1, keys + 32, 128);
  _tile_dpbf16ps(0, 1, 3);
  _tile_stored(0, scores, 16);
  sink = scores[5];
}

static void work(int ops) {  // dependent float adds, ~4 cycles each
  float x = 1;
  for (int j = 0; j < ops; ++j) x = x * 1.0001f + 0.5f;
  sink = x;
}

__attribute__((target("amx-tile,amx-bf16"))) int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return std::puts("no AMX tile state granted here"), 1;
  Config cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 16;
  cfg.colsb[1] = 64;
  _tile_loadconfig(&cfg);
  for (int i = 0; i < 16 * 64; ++i) keys[i] = 0x3f80;
  for (int i = 0; i < 128; ++i) queries[i] = 0x3f803f80;
  std::puts("| idle ALU work before the chain (cycles) | chain, cold (TSC cycles) | with a throwaway product first |");
  std::puts("|--:|--:|--:|");
  for (int gap : {100, 300, 1000, 3000, 10000, 30000}) {
    uint64_t spent[2] = {};
    for (int wake : {0, 1})
      for (int it = 0; it < 3000; ++it) {
        work(gap);
        if (wake) {
          _tile_dpbf16ps(0, 1, 2);
          work(100);
        }
        _mm_lfence();
        const uint64_t t0 = __rdtsc();
        _mm_lfence();
        chain();
        _mm_lfence();
        spent[wake] += __rdtsc() - t0;
      }
    std::printf("| ~%d | %.0f | %.0f |\n", gap * 4, spent[0] / 3000.0, spent[1] / 3000.0);
  }
  std::puts("\n| back to back, ~240 cycles of ALU work between chains | ns a chain and its work |\n|---|--:|");
  for (int mode : {0, 1, 2, 3}) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 20000; ++it) {
      work(60);
      if (mode == 1 || mode == 2) _tile_loadconfig(&cfg);
      if (mode == 3) {
        Config now;
        _tile_storeconfig(&now);
        if (std::memcmp(&now, &cfg, sizeof(cfg)) != 0) _tile_loadconfig(&cfg);
      }
      chain();
      if (mode == 2) _tile_release();
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / 20000;
    const char* name[] = {"configuration kept", "loaded every time", "loaded and released every time",
                          "read back and compared (kept)"};
    std::printf("| %s | %.0f |\n", name[mode], ns);
  }
}
