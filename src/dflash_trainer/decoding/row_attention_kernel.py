"""The Triton kernel of decoding/row_attention.py (its contract is there): one program per (cache row, KV
head), looping over that row's own key slots in blocks of BLOCK_N with an online softmax in fp32. Imported
only where Triton is installed; runs compiled on CUDA and under Triton's interpreter on the CPU.

Two ways to take the dots (a constexpr, so each is its own compiled kernel):
  TENSOR_CORES=False: q·kᵀ and p·v in fp32 (IEEE) for every input dtype, the exactly rounded reference;
  TENSOR_CORES=True (bf16 / fp16 inputs on CUDA): q·kᵀ on the inputs' dtype with fp32 accumulation (the
    products of two bf16 values are exact in fp32), p rounded to the values' dtype for p·v with fp32
    accumulation, as flash attention does (Dao et al. 2022, Algorithm 1; FlashAttention-2 §3.1). The
    softmax statistics (running max, sum) stay fp32."""

import triton
import triton.language as tl


@triton.jit
def row_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, end_ptr,
                         sq_r, sq_h, sq_g, sk_r, sk_h, sk_s, sv_r, sv_h, sv_s, so_r, so_h, so_g,
                         G, NTOK, scale, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         TENSOR_CORES: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # row offsets of a large cache pass 2³¹ elements
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + r * sq_r + h * sq_h + g[:, None] * sq_g + d[None, :], mask=g[:, None] < G, other=0.0)
    if not TENSOR_CORES:
        q = q.to(tl.float32)
    start = tl.load(start_ptr + r)
    end = tl.load(end_ptr + r)
    # query row g is token g % NTOK of the block: it sees the last token's slots moved back by its distance
    back = NTOK - 1 - g % NTOK
    lo = tl.maximum(start - back, 0)  # [BLOCK_G]
    hi = end - back
    first = tl.maximum(start - (NTOK - 1), 0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for s0 in range(first, end, BLOCK_N):  # this row's slots only: its first token's start … end − 1
        n = s0 + tl.arange(0, BLOCK_N)
        valid = n < end
        seen = (n[None, :] >= lo[:, None]) & (n[None, :] < hi[:, None])  # [BLOCK_G, BLOCK_N]
        k = tl.load(k_ptr + r * sk_r + h * sk_h + n[:, None] * sk_s + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + r * sv_r + h * sv_h + n[:, None] * sv_s + d[None, :], mask=valid[:, None], other=0.0)
        if TENSOR_CORES:
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_G, BLOCK_N] fp32 accumulation
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a query row with no slot seen yet (a window's later token in an early block) keeps 0 / 0 / −inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TENSOR_CORES:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + r * so_r + h * so_h + g[:, None] * so_g + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=g[:, None] < G)
