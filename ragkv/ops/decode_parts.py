"""The decode-attention kernel's shared-parts path (C++ spliced into ragkv.ops.decode_kernel's source, where `axpy`
and `check_kv` are defined before it): several sequences' decode rows over parts read in place, each part a pooled
block or a sequence's own rows, each (part, KV head, chunk of keys) read once for every row that reads it; the
parts merged per sequence by their log-sum-exps (APE's context rows first among themselves, then scaled by the
sequence's factor). Called through `decode_kernel.parts_attention_cpu`."""

PARTS_PATH = r"""
// Decode attention of several sequences over parts read in place (shared blocks). A part is a pooled
// block or a sequence's own rows; a query row is one (sequence, part) pair with its own rotated query and scale.
// Each (part, KV head, chunk of keys) is one work item that streams its keys and values once for every row that
// reads the part. Per sequence the parts merge by their log-sum-exps; rows of group 1 (APE's context) first merge
// among themselves, and their joint LSE is multiplied by the sequence's factor (APE's S * T).
template <typename T>
static void parts_impl(const at::Tensor& q, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs,
                       const int64_t* rpart, const float* rscale, const int64_t* rseq, const int64_t* rgroup,
                       const float* factor, int64_t B, const std::vector<at::Tensor>& masks, at::Tensor& out) {
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t P = ks.size(), Hkv = ks[0].size(0), G = Hq / Hkv;
  const int64_t chunk = 512;
  std::vector<std::vector<int64_t>> holders(P);
  for (int64_t r = 0; r < R; ++r) holders[rpart[r]].push_back(r);
  int64_t maxch = 1;
  struct Item { int64_t p, h, c; };
  std::vector<Item> items;
  for (int64_t p = 0; p < P; ++p) {
    if (holders[p].empty()) continue;
    const int64_t n = std::max<int64_t>(1, (ks[p].size(1) + chunk - 1) / chunk);
    maxch = std::max(maxch, n);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t c = 0; c < n; ++c) items.push_back({p, h, c});
  }
  // partials per (row, head, chunk, g): max, sum, unnormalized output; an unused chunk keeps sum 0
  const int64_t slots = R * Hkv * maxch * G;
  std::vector<float> pmax(slots, -std::numeric_limits<float>::infinity()), psum(slots, 0.f), pout(slots * D, 0.f);
  const T* qp = q.data_ptr<T>();
  at::parallel_for(0, items.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf;
    for (int64_t it = begin; it < end; ++it) {
      const Item& w = items[it];
      const std::vector<int64_t>& rows = holders[w.p];
      const int64_t nr = rows.size() * G;
      const int64_t s0 = w.c * chunk, n = std::min<int64_t>(ks[w.p].size(1), s0 + chunk) - s0;
      if (n <= 0) continue;
      qf.assign(nr * D, 0.f);
      for (size_t i = 0; i < rows.size(); ++i)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d)
            qf[(i * G + g) * D + d] = static_cast<float>(qp[(rows[i] * Hq + w.h * G + g) * D + d]) * rscale[rows[i]];
      // the holders' rows as one small matrix product each way (a GEMM reads each key once for all rows)
      at::Tensor kh = ks[w.p].select(0, w.h).narrow(0, s0, n), vh = vs[w.p].select(0, w.h).narrow(0, s0, n);
      if (kh.scalar_type() != at::kFloat) { kh = kh.to(at::kFloat); vh = vh.to(at::kFloat); }
      at::Tensor sc = at::mm(at::from_blob(qf.data(), {nr, D}, at::kFloat), kh.t());  // [nr, n]
      for (size_t i = 0; i < rows.size(); ++i) {  // keys a row must not see (blend: rows it recomputed itself)
        const at::Tensor& m = masks[rows[i]];
        if (m.numel() == 0) continue;
        const at::Tensor hidden = m.narrow(0, s0, n).logical_not();
        for (int64_t g = 0; g < G; ++g) sc.select(0, i * G + g).masked_fill_(hidden, -std::numeric_limits<float>::infinity());
      }
      at::Tensor mx = sc.amax(1, true);
      mx.masked_fill_(mx.isneginf(), 0.f);  // a chunk a row sees none of: its sum is 0, and the merge skips it
      sc.sub_(mx).exp_();
      at::Tensor sm = sc.sum(1), o = at::mm(sc, vh);  // [nr], [nr, D]
      const float *mp = mx.data_ptr<float>(), *spp = sm.data_ptr<float>(), *opp = o.data_ptr<float>();
      for (int64_t j = 0; j < nr; ++j) {
        const int64_t slot = ((rows[j / G] * Hkv + w.h) * maxch + w.c) * G + j % G;
        pmax[slot] = mp[j];
        psum[slot] = spp[j];
        std::memcpy(pout.data() + slot * D, opp + j * D, D * sizeof(float));
      }
    }
  });
  std::vector<std::vector<int64_t>> seq_rows(B);
  for (int64_t r = 0; r < R; ++r) seq_rows[rseq[r]].push_back(r);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> lse, outs, o1(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hq, hq = bh % Hq, h = hq / G, g = hq % G;
      lse.clear(); outs.clear();
      float m1 = -std::numeric_limits<float>::infinity(), s1 = 0.f;
      for (int64_t r : seq_rows[b])  // the joint max of group 1 first
        if (rgroup[r] == 1)
          for (int64_t c = 0; c < maxch; ++c) {
            const int64_t slot = ((r * Hkv + h) * maxch + c) * G + g;
            if (psum[slot] > 0.f) m1 = std::max(m1, pmax[slot]);
          }
      std::fill(o1.begin(), o1.end(), 0.f);
      for (int64_t r : seq_rows[b]) {
        float mr = -std::numeric_limits<float>::infinity(), sr = 0.f;
        for (int64_t c = 0; c < maxch; ++c) {
          const int64_t slot = ((r * Hkv + h) * maxch + c) * G + g;
          if (psum[slot] > 0.f) mr = std::max(mr, pmax[slot]);
        }
        if (rgroup[r] == 1) mr = m1;
        std::vector<float> orow(D, 0.f);
        for (int64_t c = 0; c < maxch; ++c) {
          const int64_t slot = ((r * Hkv + h) * maxch + c) * G + g;
          if (psum[slot] <= 0.f) continue;
          const float wgt = std::exp(pmax[slot] - mr);
          sr += wgt * psum[slot];
          axpy(wgt, pout.data() + slot * D, orow.data(), D);
        }
        if (sr <= 0.f) continue;
        if (rgroup[r] == 1) { s1 += sr; for (int64_t d = 0; d < D; ++d) o1[d] += orow[d]; continue; }
        lse.push_back(mr + std::log(sr));
        for (int64_t d = 0; d < D; ++d) outs.push_back(orow[d] / sr);
      }
      if (s1 > 0.f) {
        lse.push_back(factor[b] * (m1 + std::log(s1)));
        for (int64_t d = 0; d < D; ++d) outs.push_back(o1[d] / s1);
      }
      float top = -std::numeric_limits<float>::infinity();
      for (float l : lse) top = std::max(top, l);
      float* o = op + (b * Hq + hq) * D;
      std::fill(o, o + D, 0.f);
      float total = 0.f;
      for (size_t i = 0; i < lse.size(); ++i) {
        const float wgt = std::exp(lse[i] - top);
        total += wgt;
        axpy(wgt, outs.data() + i * D, o, D);
      }
      if (total > 0.f) for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
  });
}

at::Tensor parts_attention(at::Tensor q, std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, at::Tensor rpart,
                           at::Tensor rscale, at::Tensor rseq, at::Tensor rgroup, at::Tensor factor, int64_t B,
                           std::vector<at::Tensor> masks) {
  TORCH_CHECK(q.dim() == 3, "q [R, Hq, D]");
  TORCH_CHECK(!ks.empty() && ks.size() == vs.size(), "one value tensor per key tensor");
  for (size_t p = 0; p < ks.size(); ++p) {
    check_kv(q, ks[p], vs[p]);
    TORCH_CHECK(ks[p].size(0) == ks[0].size(0) && ks[p].size(1) == vs[p].size(1), "parts of one model");
  }
  q = q.contiguous();
  rpart = rpart.contiguous(); rseq = rseq.contiguous(); rgroup = rgroup.contiguous();
  rscale = rscale.to(at::kFloat).contiguous(); factor = factor.to(at::kFloat).contiguous();
  const int64_t R = q.size(0);
  TORCH_CHECK((int64_t)masks.size() == R, "one mask (or an empty tensor) per row");
  for (int64_t r = 0; r < R; ++r) {
    const at::Tensor& m = masks[r];
    TORCH_CHECK(m.numel() == 0 || (m.scalar_type() == at::kBool && m.dim() == 1 &&
                                   m.size(0) == ks[rpart.data_ptr<int64_t>()[r]].size(1)), "a row's mask: bool [keys]");
    TORCH_CHECK(rpart.data_ptr<int64_t>()[r] >= 0 && rpart.data_ptr<int64_t>()[r] < (int64_t)ks.size(), "part");
    TORCH_CHECK(rseq.data_ptr<int64_t>()[r] >= 0 && rseq.data_ptr<int64_t>()[r] < B, "sequence");
  }
  auto out = at::empty({B, q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kFloat)
    parts_impl<float>(q, ks, vs, rpart.data_ptr<int64_t>(), rscale.data_ptr<float>(), rseq.data_ptr<int64_t>(),
                      rgroup.data_ptr<int64_t>(), factor.data_ptr<float>(), B, masks, out);
  else if (q.scalar_type() == at::kBFloat16)
    parts_impl<at::BFloat16>(q, ks, vs, rpart.data_ptr<int64_t>(), rscale.data_ptr<float>(),
                             rseq.data_ptr<int64_t>(), rgroup.data_ptr<int64_t>(), factor.data_ptr<float>(), B, masks,
                             out);
  else TORCH_CHECK(false, "parts_attention supports float32 and bfloat16");
  return out;
}
"""
