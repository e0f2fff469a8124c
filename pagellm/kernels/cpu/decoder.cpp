// A whole decoder forward for a few rows (decode and verification steps) in one call: the same kernels
// the Python modules call one by one (pagellm/model/models/llama.py), in the same order, without
// ~300 Python-level calls per token. Used only when every matmul of the model is packed. Steps past the
// few-row kernels' limit under `--dtype auto` with AMX tiles (amx_step) run the module path's bf16 chain
// instead: AMX products with bf16 outputs, rope_bf16, add_bf16_rmsnorm, silu_mul_bf16.
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

extern "C" {
void pagellm_packed_linear(int kind, int int8_x, const float* x, int64_t ldx, int M, int K, const void* qs,
                           const float* d, const float* m, int N, float* y, int64_t ldy, int nthreads);
int pagellm_int8_tiles_linear(int kind, int planes, int method, const float* x, int64_t ldx, int M, int K,
                              const uint8_t* codes, const float* d, const float* m, int N, float* y, int64_t ldy,
                              int nthreads);
void pagellm_add_rmsnorm(float* x, const float* residual, const float* weight, float* out, int T, int C, float eps,
                         int nthreads);
void pagellm_rope(float* x, int64_t ldx, int T, int heads, int D, const float* cos_table, const float* sin_table,
                  const int64_t* positions, int nthreads);
void pagellm_silu_mul(const float* gate_up, int T, int I, float* out, int nthreads);
void pagellm_silu_mul_bf16(const uint16_t* gate_up, int T, int I, uint16_t* out, int nthreads);
void pagellm_add_bf16_rmsnorm(const uint16_t* x, float* residual, const float* weight, float* out, int T, int C,
                              float eps, int nthreads);
void pagellm_rope_bf16(const uint16_t* x, int64_t ldx, float* out, int64_t ldo, int T, int C, int heads, int D,
                       const float* cos_table, const float* sin_table, const int64_t* positions, int nthreads);
int pagellm_packed_linear_amx(int kind, const void* x, int64_t ldx, int x_bf16, int M, int K, const uint8_t* codes,
                              const float* d, const float* m, int N, void* y, int64_t ldy, int y_bf16, int nthreads);
int pagellm_packed_linear_bf16dp(int kind, const void* x, int64_t ldx, int x_bf16, int M, int K,
                                 const uint8_t* codes, const float* d, const float* m, int N, void* y, int64_t ldy,
                                 int y_bf16, int nthreads);
int pagellm_write_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, int T, int KV, int D, void* kv,
                     int64_t num_blocks, int block_size, const int64_t* slots, int kv_format, int nthreads);
int pagellm_paged_attention(const float* q, int64_t ldq, int T, int H, int D, const void* kv, int64_t num_blocks,
                            int block_size, int KV, const int64_t* block_tables, int64_t table_stride,
                            const int64_t* row_seq, const int64_t* row_pos, int window, float softmax_scale,
                            float* out, int nthreads, int kv_format);
}

// Mirrors of the ctypes Structures in pagellm/kernels/decoder.py (field order and types must match).
struct PackedMatrix {
    int32_t kind;  // pagellm/kernels/ops.py KIND_CODES (0: q4_1, 1: q8_0, ...)
    int32_t out_features, in_features;
    const void* qs;
    const float* d;
    const float* m;
    const float* bias;  // may be null
    // the blocks in AMX tile order (pagellm/kernels/amx.py), or null: kind 0 q4_1, 1 q8_0
    const uint8_t* amx_codes;
    const float* amx_d;
    const float* amx_m;
    // the blocks in int8 tile order (pagellm/kernels/int8_tiles.py), or null: the few-row int8 products' layout
    const uint8_t* i8_codes;
    const float* i8_d;
    const float* i8_m;
};

struct DecoderLayer {
    PackedMatrix qkv, o, gate_up, down;
    const float* input_norm;
    const float* post_norm;
};

struct DecoderDims {
    int32_t hidden, heads, kv_heads, head_dim, intermediate, window;
    int32_t int8_activations;  // 0, or int8 x per 32-block in the matmuls (1, or 2: two planes; quant_linear.cpp)
    int32_t kv_format;  // the KV cache's element format (KvFormat, kv_format.h)
    int32_t amx_step;  // this step takes the bf16 chain and the products over tile-order blocks (set per call):
                       // 1 on AMX tiles, 2 on vdpbf16ps (quant_linear_bf16dp.cpp)
    float eps, scale;
    const float* rope_cos;
    const float* rope_sin;
};

static void matmul(const PackedMatrix& w, const float* x, int T, float* y, int int8_x, int nthreads) {
    // int8 activations over blocks in tile order where the layer has them (as the module path: Linear.int8_tiles)
    const bool tiles = int8_x && w.i8_codes &&
                       pagellm_int8_tiles_linear(w.kind, int8_x, 0, x, w.in_features, T, w.in_features, w.i8_codes,
                                                 w.i8_d, w.i8_m, w.out_features, y, w.out_features, nthreads) == 0;
    if (!tiles)
        pagellm_packed_linear(w.kind, int8_x, x, w.in_features, T, w.in_features, w.qs, w.d, w.m, w.out_features, y,
                              w.out_features, nthreads);
    if (w.bias)
        for (int t = 0; t < T; ++t)
            for (int i = 0; i < w.out_features; ++i) y[(int64_t)t * w.out_features + i] += w.bias[i];
}

// The product over tile-order blocks x (float32, or bf16 with x_bf16) @ W^T -> bf16 y: the module path's
// amx.linear for a layer whose output feeds a bf16 op (Linear.bf16_out); method as DecoderDims.amx_step.
static int amx_matmul(const PackedMatrix& w, const void* x, bool x_bf16, int T, uint16_t* y, int nthreads,
                      int method) {
    const auto kernel = method == 2 ? pagellm_packed_linear_bf16dp : pagellm_packed_linear_amx;
    return kernel(w.kind, x, w.in_features, x_bf16, T, w.in_features, w.amx_codes, w.amx_d, w.amx_m, w.out_features,
                  y, w.out_features, 1, nthreads);
}

// One AMX step's layers (see the header): h holds the first layer's input norm; returns 0 or an error.
static int amx_layers(const DecoderDims* dims, const DecoderLayer* layers, int num_layers, void* const* kv_caches,
                      int64_t num_blocks, int block_size, const float* final_norm, int T, const int64_t* positions,
                      const int64_t* slots, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* row_seq, int nthreads, std::vector<float>& residual, std::vector<float>& h) {
    const int C = dims->hidden, H = dims->heads, KV = dims->kv_heads, D = dims->head_dim, I = dims->intermediate;
    const int qkv_width = (H + 2 * KV) * D;
    std::vector<uint16_t> qkv_b((int64_t)T * qkv_width), out_b((int64_t)T * C);
    std::vector<uint16_t> gate_up_b((int64_t)T * 2 * I), act_b((int64_t)T * I);
    std::vector<float> qkv((int64_t)T * qkv_width), attn((int64_t)T * H * D);
    for (int l = 0; l < num_layers; ++l) {
        const DecoderLayer& L = layers[l];
        int rc = amx_matmul(L.qkv, h.data(), false, T, qkv_b.data(), nthreads, dims->amx_step);
        if (rc) return rc;
        pagellm_rope_bf16(qkv_b.data(), qkv_width, qkv.data(), qkv_width, T, qkv_width, H + KV, D, dims->rope_cos,
                          dims->rope_sin, positions, nthreads);
        const float* k = qkv.data() + H * D;
        const float* v = k + KV * D;
        rc = pagellm_write_kv(k, qkv_width, v, qkv_width, T, KV, D, kv_caches[l], num_blocks, block_size, slots,
                              dims->kv_format, nthreads);
        if (!rc)
            rc = pagellm_paged_attention(qkv.data(), qkv_width, T, H, D, kv_caches[l], num_blocks, block_size, KV,
                                         block_tables, table_stride, row_seq, positions, dims->window, dims->scale,
                                         attn.data(), nthreads, dims->kv_format);
        if (!rc) rc = amx_matmul(L.o, attn.data(), false, T, out_b.data(), nthreads, dims->amx_step);
        if (rc) return rc;
        pagellm_add_bf16_rmsnorm(out_b.data(), residual.data(), L.post_norm, h.data(), T, C, dims->eps, nthreads);
        rc = amx_matmul(L.gate_up, h.data(), false, T, gate_up_b.data(), nthreads, dims->amx_step);
        if (rc) return rc;
        pagellm_silu_mul_bf16(gate_up_b.data(), T, I, act_b.data(), nthreads);
        rc = amx_matmul(L.down, act_b.data(), true, T, out_b.data(), nthreads, dims->amx_step);
        if (rc) return rc;
        const float* next_norm = l + 1 < num_layers ? layers[l + 1].input_norm : final_norm;
        pagellm_add_bf16_rmsnorm(out_b.data(), residual.data(), next_norm, h.data(), T, C, dims->eps, nthreads);
    }
    return 0;
}

// x: [T, hidden] embeddings in, final normed hidden states out (in place). kv_caches: one pointer per
// layer to [2, num_blocks, block_size, kv_heads, W] in the format kv_format (attention.cpp). Returns 0,
// or the attention kernel's error.
extern "C" int pagellm_decoder_forward(const DecoderDims* dims, const DecoderLayer* layers, int num_layers,
                                       void* const* kv_caches, int64_t num_blocks, int block_size,
                                       const float* final_norm, float* x, int T, const int64_t* positions,
                                       const int64_t* slots, const int64_t* block_tables, int64_t table_stride,
                                       const int64_t* row_seq, int nthreads) {
    const int C = dims->hidden, H = dims->heads, KV = dims->kv_heads, D = dims->head_dim;
    const int qkv_width = (H + 2 * KV) * D;
    const int int8_x = dims->int8_activations;
    std::vector<float> residual(x, x + (int64_t)T * C), h((int64_t)T * C);
    pagellm_add_rmsnorm(residual.data(), nullptr, layers[0].input_norm, h.data(), T, C, dims->eps, nthreads);
    if (dims->amx_step) {
        const int rc = amx_layers(dims, layers, num_layers, kv_caches, num_blocks, block_size, final_norm, T,
                                  positions, slots, block_tables, table_stride, row_seq, nthreads, residual, h);
        if (rc) return rc;
        std::memcpy(x, h.data(), sizeof(float) * T * C);
        return 0;
    }
    std::vector<float> delta((int64_t)T * C), qkv((int64_t)T * qkv_width), attn((int64_t)T * H * D);
    std::vector<float> gate_up((int64_t)T * 2 * dims->intermediate), act((int64_t)T * dims->intermediate);
    for (int l = 0; l < num_layers; ++l) {
        const DecoderLayer& L = layers[l];
        matmul(L.qkv, h.data(), T, qkv.data(), int8_x, nthreads);
        pagellm_rope(qkv.data(), qkv_width, T, H + KV, D, dims->rope_cos, dims->rope_sin, positions, nthreads);
        const float* k = qkv.data() + H * D;
        const float* v = k + KV * D;
        int rc = pagellm_write_kv(k, qkv_width, v, qkv_width, T, KV, D, kv_caches[l], num_blocks, block_size, slots,
                                  dims->kv_format, nthreads);
        if (!rc)
            rc = pagellm_paged_attention(qkv.data(), qkv_width, T, H, D, kv_caches[l], num_blocks, block_size, KV,
                                         block_tables, table_stride, row_seq, positions, dims->window, dims->scale,
                                         attn.data(), nthreads, dims->kv_format);
        if (rc) return rc;
        matmul(L.o, attn.data(), T, delta.data(), int8_x, nthreads);
        // delta += residual, h = norm(delta): delta is now the residual stream, so swap the names.
        pagellm_add_rmsnorm(delta.data(), residual.data(), L.post_norm, h.data(), T, C, dims->eps, nthreads);
        std::swap(delta, residual);
        matmul(L.gate_up, h.data(), T, gate_up.data(), int8_x, nthreads);
        pagellm_silu_mul(gate_up.data(), T, dims->intermediate, act.data(), nthreads);
        matmul(L.down, act.data(), T, delta.data(), int8_x, nthreads);
        const float* next_norm = l + 1 < num_layers ? layers[l + 1].input_norm : final_norm;
        pagellm_add_rmsnorm(delta.data(), residual.data(), next_norm, h.data(), T, C, dims->eps, nthreads);
        std::swap(delta, residual);
    }
    std::memcpy(x, h.data(), sizeof(float) * T * C);
    return 0;
}
