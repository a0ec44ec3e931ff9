"""moejax: an open training system for large Mixture-of-Experts language models on JAX.

Dimension legend, one meaning per letter across the package (shape suffixes such as `x_TD`, jaxtyping
annotations, module docstrings):

  B batch (sequences)        S sequence (positions)       T tokens (B*S, or one shard's)
  D model width              V vocab                      L layers
  H query heads              G KV heads                   Hd head dim
  Q GatedNorm rank           C SConv channels             J SConv taps
  E experts (E_loc local)    K choices (top-k)            A assignments (T*K)
  Z latent width             F expert width               U shared experts (Fs their width)
  X shards on the `expert` mesh axis                      W transport waves
  P sender pool rows per destination per wave             M header rows (ceil(Md*P/Z))
  Md header digits per expert id (base 256)
  Y rows of one destination's block (M + P)               R rows per local expert (receiver capacity)
  ER expert slots (E_loc*R)  N rows a gather reads (the W*X*P send rows in the transport)
  O rows a gather writes     I readers per source row     Nb histogram bins (QB)
  Bk blocks of b rows (grouped GEMM)                      Pd padded rows (Bk*b)

PartitionSpecs are never abbreviated to `P` in the package: they are the named constants of
`moejax.parallel.mesh`.
"""

__version__ = "0.1.0"
