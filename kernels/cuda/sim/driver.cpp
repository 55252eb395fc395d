// The simulator's driver: reads buffers and a list of launches on stdin, runs them, writes the
// buffers back on stdout. Built together with the kernel sources (see `kernels/tests/cuda_sim.rs`
// for the format, which that test writes).

#include <cstdio>
#include <map>
#include <string>
#include <utility>

template <typename... A, std::size_t... I>
void sim_call_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*reinterpret_cast<A*>(args[I])...);
}

template <typename... A>
std::function<void(void**)> sim_entry(void (*f)(A...)) {
    return [f](void** args) { sim_call_impl(f, args, std::index_sequence_for<A...>{}); };
}

#define REG(name) table[#name] = sim_entry(&name);
#define REG_TYPED(suffix, T)                                                                                      \
    REG(rms_norm_##suffix) REG(rope_##suffix) REG(silu_mul_##suffix) REG(silu_mul_fused_##suffix) REG(split_columns_##suffix) \
    REG(add_assign_##suffix) REG(gather_rows_##suffix) REG(add_bias_##suffix) REG(write_kv_##suffix)              \
    REG(rope_write_kv_##suffix)                                                                                   \
    REG(attn_decode_##suffix) REG(attn_combine_##suffix) REG(attn_prefill_##suffix) REG(lora_shrink_##suffix)     \
    REG(lora_expand_##suffix) REG(attn_decode_g2_d4_##suffix) REG(attn_decode_g2_d8_##suffix)                     \
    REG(attn_decode_g4_d4_##suffix) REG(attn_decode_g4_d8_##suffix) REG(attn_decode_g8_d4_##suffix)               \
    REG(attn_decode_g8_d8_##suffix)

static bool read_exact(void* p, size_t n) { return fread(p, 1, n, stdin) == n; }

template <typename T> static T read_val() {
    T v{};
    if (!read_exact(&v, sizeof(T))) {
        fprintf(stderr, "sim: truncated input\n");
        exit(2);
    }
    return v;
}

int main() {
    std::map<std::string, std::function<void(void**)>> table;
    FOR_EACH_DTYPE(REG_TYPED)
    REG(argmax_rows)
    REG(sample_rows)
    REG(row_logprobs)

    const unsigned nbufs = read_val<unsigned>();
    std::vector<std::vector<uint64_t>> bufs(nbufs);
    std::vector<size_t> lens(nbufs);
    for (unsigned i = 0; i < nbufs; ++i) {
        lens[i] = read_val<uint64_t>();
        bufs[i].assign(lens[i] / 8 + 2, 0);
        if (!read_exact(bufs[i].data(), lens[i])) return 2;
    }
    const unsigned nlaunch = read_val<unsigned>();
    for (unsigned l = 0; l < nlaunch; ++l) {
        std::string name(read_val<unsigned>(), '\0');
        if (!read_exact(name.data(), name.size())) return 2;
        dim3 grid{read_val<unsigned>(), read_val<unsigned>(), read_val<unsigned>()};
        const unsigned block = read_val<unsigned>(), smem = read_val<unsigned>();
        const unsigned nargs = read_val<unsigned>();
        std::vector<uint64_t> storage(nargs);
        std::vector<void*> args(nargs);
        for (unsigned a = 0; a < nargs; ++a) {
            const unsigned char kind = read_val<unsigned char>();
            if (kind == 0) {
                const unsigned id = read_val<unsigned>();
                void* p = bufs.at(id).data();
                std::memcpy(&storage[a], &p, sizeof p);
            } else if (kind == 1) {
                storage[a] = 0;
            } else {
                const unsigned n = read_val<unsigned>();
                if (n > 8 || !read_exact(&storage[a], n)) return 2;
            }
            args[a] = &storage[a];
        }
        auto it = table.find(name);
        if (it == table.end()) {
            fprintf(stderr, "sim: no kernel %s\n", name.c_str());
            return 3;
        }
        auto entry = it->second;
        void** argv = args.data();
        sim_launch(grid, block, smem, [&] { entry(argv); });
    }
    for (unsigned i = 0; i < nbufs; ++i) {
        const uint64_t n = lens[i];
        fwrite(&n, 8, 1, stdout);
        fwrite(bufs[i].data(), 1, n, stdout);
    }
    return 0;
}
