"""The fused sampling kernel (greedy argmax / Gumbel-max draw / NaN flag) and its torch reference.

GPU tests carry the gpu mark; the reference's tests at the bottom run on the CPU everywhere.
"""

import pytest
import torch

from tests.dataplane.kernels.reference import sample_tokens_native

gpu = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LLAMA3_VOCAB = 128256
# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124}
SMALL_LOGITS = [1.0, 0.5, 0.0, -0.3, -1.0, 0.2, 0.8, -0.6]


def sample(logits: torch.Tensor, temperature, seeds) -> tuple[torch.Tensor, torch.Tensor]:
    from modelfleet.dataplane.kernels.sampling import sample_tokens

    rows, device = logits.shape[0], logits.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32)
    if temperature.dim() == 0:
        temperature = temperature.expand(rows).contiguous()
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    return sample_tokens(logits, temperature.to(device), seeds.to(device))


def distinct_seeds(count: int, salt: int = 0) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64) * 1_000_003 + 7919 * salt + 12345


def random_logits(rows: int, vocab: int, dtype: torch.dtype, device, strided: bool = False) -> torch.Tensor:
    """Logits [rows, vocab] (3x standard normal); strided: a view at an odd offset into wider rows."""
    if not strided:
        return (3 * torch.randn(rows, vocab, device=device)).to(dtype)
    wide = (3 * torch.randn(rows, vocab + 37, device=device)).to(dtype)
    return wide[:, 3 : 3 + vocab]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against probabilities, and its degrees of freedom. Cells
    expected to hold fewer than 5 draws are pooled into one, so the chi-square approximation holds; a
    pool of probability 0 must stay empty."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    expected = probs * counts.sum()
    small = expected < 5
    pooled_count, pooled_expected = counts[small].sum(), expected[small].sum()
    counts, expected = counts[~small], expected[~small]
    if pooled_expected > 0:
        counts = torch.cat([counts, pooled_count.unsqueeze(0)])
        expected = torch.cat([expected, pooled_expected.unsqueeze(0)])
    else:
        assert pooled_count == 0, "tokens of probability 0 were drawn"
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return statistic, len(counts) - 1


def assert_draws_follow(tokens: torch.Tensor, logits_row: torch.Tensor, temperature: float) -> None:
    probs = torch.softmax(logits_row.float().cpu() / temperature, dim=-1)
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel())
    statistic, dof = chi_square(counts, probs)
    assert statistic < CHI2_CRITICAL_P001[dof], (statistic, dof, counts.tolist(), probs.tolist())


# ---------------------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize("vocab", [1000, LLAMA3_VOCAB])
@pytest.mark.parametrize("strided", [False, True])
def test_greedy_is_torch_argmax(device, dtype, rows, vocab, strided):
    logits = random_logits(rows, vocab, dtype, device, strided)
    # equal maxima in several places of row 0 (bf16/fp16 rows also tie by themselves)
    top = logits[0].float().max().item() + 1.0
    logits[0, [vocab - 1, 900, 700]] = top
    tokens, nan_rows = sample(logits, 0.0, distinct_seeds(rows))
    assert torch.equal(tokens, logits.float().argmax(dim=-1))
    assert tokens[0].item() == 700
    assert not nan_rows.any()


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_ties_take_the_first_index(device, dtype):
    vocab = LLAMA3_VOCAB
    logits = torch.randn(5, vocab, device=device).to(dtype)
    logits[0] = 0.0  # all equal
    logits[1, [100_000, 7 + 2048, 7 + 512, 7]] = 10.0  # same lane, other sub-block, tile, chunk
    logits[2] = float("-inf")
    logits[3, [vocab - 2, vocab - 1]] = 10.0  # the last tile, partly masked
    logits[4, [vocab - 1, 2049]] = 10.0
    want = logits.float().argmax(dim=-1)
    assert want.tolist() == [0, 7, 0, vocab - 2, 2049]
    temperature = torch.tensor([0.0, -1.0, 0.0, 0.0, 0.0])
    tokens, _ = sample(logits, temperature, distinct_seeds(5))
    assert torch.equal(tokens, want)
    for row in range(5):  # each row alone: split over many more programs
        alone, _ = sample(logits[row : row + 1], temperature[row : row + 1], distinct_seeds(1))
        assert alone.item() == want[row].item()


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, LLAMA3_VOCAB])
def test_nan_rows_are_flagged_and_others_not(device, dtype, vocab):
    logits = random_logits(6, vocab, dtype, device)
    logits[2, vocab - 1] = float("nan")  # greedy row, last column
    logits[4, 0] = float("nan")  # sampling row, first column
    logits[5, :] = float("nan")
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7, 1.0, 0.0])
    tokens, nan_rows = sample(logits, temperature, distinct_seeds(6))
    assert nan_rows.tolist() == [False, False, True, False, True, True]
    assert ((tokens >= 0) & (tokens < vocab)).all()
    want = logits.float().argmax(dim=-1)
    assert tokens[0].item() == want[0].item()


@gpu
@pytest.mark.parametrize("vocab", [1000, LLAMA3_VOCAB])
def test_same_seed_same_token_whatever_the_batch(device, vocab):
    rows = 256
    logits = random_logits(rows, vocab, torch.bfloat16, device)
    temperature = torch.rand(rows) + 0.5
    seeds = torch.randint(-(2**62), 2**62, (rows,), dtype=torch.int64)
    tokens, _ = sample(logits, temperature, seeds)
    again, _ = sample(logits, temperature, seeds)
    assert torch.equal(tokens, again)
    perm = torch.randperm(rows)
    permuted, _ = sample(logits[perm.to(device)], temperature[perm], seeds[perm])
    assert torch.equal(permuted, tokens[perm.to(device)])
    for row in [0, 17, rows - 1]:  # alone (the vocab split over many programs) and among 2 others
        alone, _ = sample(logits[row : row + 1], temperature[row : row + 1], seeds[row : row + 1])
        assert alone.item() == tokens[row].item()
        others = random_logits(2, vocab, torch.bfloat16, device)
        mixed = torch.cat([others[:1], logits[row : row + 1], others[1:]])
        mixed_tokens, _ = sample(mixed, [1.0, temperature[row].item(), 0.3], [1, seeds[row].item(), 2])
        assert mixed_tokens[1].item() == tokens[row].item()


@gpu
@pytest.mark.parametrize("vocab", [1000, LLAMA3_VOCAB])
def test_different_seeds_give_different_tokens(device, vocab):
    rows = 256
    flat = torch.zeros(1, vocab, device=device).expand(rows, vocab)  # row stride 0
    tokens, _ = sample(flat, 1.0, distinct_seeds(rows))
    # uniform over the vocab: 256 draws from 1000 give about 226 distinct values, from 128256 about 256
    assert tokens.unique().numel() >= (180 if vocab == 1000 else 250)
    same, _ = sample(flat, 1.0, torch.full((rows,), 99))
    assert same.unique().numel() == 1


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_over_temperature(device, dtype, temperature):
    rows = 20000
    row = torch.tensor(SMALL_LOGITS, device=device).to(dtype)
    tokens, _ = sample(row.expand(rows, -1), temperature, distinct_seeds(rows, salt=1))
    assert_draws_follow(tokens, row, temperature)


@gpu
def test_draws_follow_softmax_over_a_large_vocab(device):
    """Eight live columns spread over the chunks of a 128k row; the rest of probability 0."""
    rows, vocab = 2048, LLAMA3_VOCAB
    row = torch.full((vocab,), -1e4, device=device)
    row[[0, 511, 2048, 40_000, 64_001, 100_000, vocab - 2, vocab - 1]] = torch.tensor(
        SMALL_LOGITS, device=device
    )
    row = row.to(torch.bfloat16)
    logits = row.expand(rows, -1).contiguous()  # real rows, as the model writes them
    tokens, _ = sample(logits, 1.0, distinct_seeds(rows, salt=2))
    assert_draws_follow(tokens, row, 1.0)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_very_negative_and_minus_inf_logits_are_never_chosen(device, dtype):
    rows, vocab = 256, LLAMA3_VOCAB
    logits = torch.randn(rows, vocab, device=device).to(dtype)
    kind = torch.randint(0, 3, (vocab,), device=device)  # 0: normal, 1: very negative, 2: -inf
    very_negative = -6e4 if dtype == torch.float16 else -1e30
    logits[:, kind == 1] = very_negative
    logits[:, kind == 2] = float("-inf")
    logits[0] = float("-inf")
    logits[0, 12345] = very_negative  # the only finite logit wins
    temperature = torch.tensor([1.0, 0.0, 0.01, 5.0] * (rows // 4))
    tokens, nan_rows = sample(logits, temperature, distinct_seeds(rows))
    assert tokens[0].item() == 12345
    assert (kind[tokens[1:]] == 0).all()
    assert not nan_rows.any()


@gpu
def test_temperatures_mix_within_a_batch(device):
    vocab = 1000
    row = torch.randn(vocab, device=device)
    peaked = row.clone()
    peaked[5] = 100.0
    logits = torch.stack([row, row, row, row, peaked, row])
    temperature = torch.tensor([0.0, 1.0, -1.0, 0.7, 1.0, 2.0])
    seeds = distinct_seeds(6)
    tokens, _ = sample(logits, temperature, seeds)
    argmax = row.argmax().item()
    assert tokens[0].item() == argmax and tokens[2].item() == argmax
    assert tokens[4].item() == 5
    for i in [1, 3, 5]:
        alone, _ = sample(logits[i : i + 1], temperature[i : i + 1], seeds[i : i + 1])
        assert alone.item() == tokens[i].item()
    # the sampling rows do sample: over many seeds, T=1 leaves the argmax of these logits often
    many, _ = sample(row.expand(64, -1), 1.0, distinct_seeds(64, salt=3))
    assert (many != argmax).sum().item() > 10


@gpu
def test_outputs_and_no_host_synchronisation(device):
    from modelfleet.dataplane.kernels.sampling import sample_tokens

    logits = torch.randn(4, 5000, device=device)
    temperature = torch.tensor([0.0, 1.0, 0.5, 0.0], device=device)
    seeds = distinct_seeds(4).to(device)
    sample_tokens(logits, temperature, seeds)  # compiled before the check
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, nan_rows = sample_tokens(logits, temperature, seeds)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert tokens.dtype == torch.int64 and nan_rows.dtype == torch.bool
    assert tokens.shape == nan_rows.shape == (4,)
    assert tokens.device == nan_rows.device == logits.device
    empty_tokens, empty_nan = sample_tokens(logits[:0], temperature[:0], seeds[:0])
    assert empty_tokens.shape == empty_nan.shape == (0,)


@gpu
def test_replays_inside_a_cuda_graph(device):
    from modelfleet.dataplane.kernels.sampling import sample_tokens

    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    rows, vocab = 8, LLAMA3_VOCAB
    logits = torch.randn(rows, vocab, device=device)
    temperature = torch.tensor([0.0, 1.0] * (rows // 2), device=device)
    seeds = distinct_seeds(rows).to(device)
    sample_tokens(logits, temperature, seeds)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, nan_rows = sample_tokens(logits, temperature, seeds)
    fresh = torch.randn(rows, vocab, device=device)
    fresh[3, 10] = float("nan")
    logits.copy_(fresh)
    seeds.add_(1)
    graph.replay()
    want_tokens, want_nan = sample_tokens(fresh, temperature, seeds)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(nan_rows, want_nan)
    assert nan_rows.tolist() == [False, False, False, True, False, False, False, False]


@gpu
def test_a_new_batch_size_compiles_nothing(device):
    """Prefill steps sample any number of rows; a row count of a new kind (one, odd, a multiple of 16)
    must reuse the compiled kernels, or its first step stalls for a compilation in the middle of serving."""
    from modelfleet.dataplane.kernels import sampling

    if device.type != "cuda":
        pytest.skip("counts compiled variants of CUDA kernels")

    def compiled() -> int:
        return sum(
            len(entry[0])
            for k in (sampling._chunk_kernel, sampling._reduce_kernel)
            for entry in k.device_caches.values()
        )

    def run(rows: int) -> None:
        temperature = torch.tensor([0.0, 0.7] * rows, device=device)[:rows]
        sample(random_logits(rows, LLAMA3_VOCAB, torch.bfloat16, device), temperature, distinct_seeds(rows))

    run(5)
    before = compiled()
    for rows in (1, 2, 3, 16, 17, 64, 100, 256, 513):
        run(rows)
    assert compiled() == before


@gpu
def test_rejects_bad_arguments(device):
    from modelfleet.dataplane.kernels.sampling import sample_tokens

    logits = torch.randn(4, 64, device=device)
    temperature = torch.ones(4, device=device)
    seeds = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="logits needs a contiguous last"):
        sample_tokens(logits[:, ::2], temperature, seeds)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        sample_tokens(logits[0], temperature, seeds)
    with pytest.raises(ValueError, match="logits must be bfloat16"):
        sample_tokens(logits.double(), temperature, seeds)
    with pytest.raises(ValueError, match=r"temperature must be torch\.float32"):
        sample_tokens(logits, temperature.double(), seeds)
    with pytest.raises(ValueError, match=r"seeds must be torch\.int64 of shape"):
        sample_tokens(logits, temperature, seeds[:3])


# ------------------------------------------------------------------------------- reference (CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_greedy_is_torch_argmax(dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(16, 1000)).to(dtype)
    logits[0, [900, 40, 41]] = 100.0
    temperature = torch.tensor([0.0, 1.0, -2.0, 0.5] * 4)
    tokens, nan_rows = sample_tokens_native(logits, temperature, distinct_seeds(16))
    greedy = temperature <= 0
    assert torch.equal(tokens[greedy], logits.float().argmax(dim=-1)[greedy])
    assert tokens[0].item() == 40
    assert tokens.dtype == torch.int64 and not nan_rows.any()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_native_draws_follow_softmax(temperature):
    rows = 20000
    row = torch.tensor(SMALL_LOGITS)
    generator = torch.Generator().manual_seed(1)
    tokens, _ = sample_tokens_native(
        row.expand(rows, -1), torch.full((rows,), temperature), distinct_seeds(rows), generator=generator
    )
    assert_draws_follow(tokens, row, temperature)


def test_native_seeded_rows_follow_softmax_and_ignore_the_batch():
    rows = 5000
    row = torch.tensor(SMALL_LOGITS)
    seeds = distinct_seeds(rows, salt=4)
    tokens, _ = sample_tokens_native(row.expand(rows, -1), torch.ones(rows), seeds)
    assert_draws_follow(tokens, row, 1.0)
    logits = torch.randn(6, 300)
    temperature = torch.tensor([1.0, 0.0, 0.8, 1.5, 1.0, 0.0])
    batch_tokens, _ = sample_tokens_native(logits, temperature, distinct_seeds(6))
    for i in range(6):
        alone, _ = sample_tokens_native(
            logits[i : i + 1], temperature[i : i + 1], distinct_seeds(6)[i : i + 1]
        )
        assert alone.item() == batch_tokens[i].item()


def test_native_flags_nan_rows():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    tokens, nan_rows = sample_tokens_native(logits, torch.tensor([0.0, 0.0, 1.0]), distinct_seeds(3))
    assert nan_rows.tolist() == [False, True, False]
    assert ((tokens >= 0) & (tokens < 50)).all()


# ----------------------------------------------------------------------------- grammar bitmasks


def padded_mask(rows: int, vocab: int, device, allow: float = 0.3, seed: int = 0):
    """A TokenBitmask over a vocabulary padded past its tokenizer: the first vocab - 40 ids direct, two
    far stops (vocab - 7 and vocab - 1) after them, random bits (each id allowed with `allow`)."""
    from modelfleet.dataplane.kernels.sampling import TokenBitmask

    num_direct = vocab - 40
    g = torch.Generator().manual_seed(seed)
    grammar_ids = num_direct + 2
    words = (grammar_ids + 31) // 32
    allowed = torch.rand(rows, words * 32, generator=g) < allow
    packed = (allowed.view(rows, words, 32).long() << torch.arange(32)).sum(-1)
    bits = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    far = torch.tensor([vocab - 7, vocab - 1], dtype=torch.int32)
    masked_rows = torch.ones(rows, dtype=torch.int32)
    return TokenBitmask(bits.to(device), num_direct, far.to(device), masked_rows.to(device))


@gpu
@pytest.mark.parametrize("vocab", [1000, LLAMA3_VOCAB])
def test_a_bitmask_limits_each_row_to_its_allowed_tokens(device, vocab):
    from modelfleet.dataplane.kernels.sampling import sample_tokens

    from tests.dataplane.kernels.reference import bitmask_allowed

    rows = 7
    mask = padded_mask(rows, vocab, device)
    logits = random_logits(rows, vocab, torch.float32, device)
    # row 6 is free (an unconstrained request's): its best logit, on a padded id, stays
    mask.masked_rows[6] = 0
    mask.bits[6] = 0
    logits[6, vocab - 20] = 1e4
    # row 1: the best logits sit on padded ids no grammar has, then on a far stop it does not allow
    logits[1, vocab - 20] = 1e4
    logits[1, vocab - 7] = 1e3
    first_far = mask.num_direct  # grammar id of vocab - 7: its bit cleared
    mask.bits[1, first_far // 32] &= ~(1 << (first_far % 32))
    # row 2: only one far stop allowed, and NaN in a column the mask removes
    mask.bits[2] = 0
    far_bit = mask.num_direct + 1  # grammar id of vocab - 1
    mask.bits[2, far_bit // 32] = 1 << (far_bit % 32)
    logits[2, 5] = float("nan")
    temperature = torch.tensor([0.0, 0.0, 1.0, 0.7, 0.0, 2.0, 0.0])
    tokens, nan_rows = sample_tokens(
        logits, temperature.to(device), distinct_seeds(rows).to(device), mask=mask
    )
    allowed = bitmask_allowed(mask, vocab)
    assert allowed[torch.arange(rows), tokens].all()
    assert tokens[2].item() == vocab - 1
    assert not nan_rows.any()
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], masked.argmax(dim=-1)[greedy.to(device)])
    assert tokens[1].item() not in (vocab - 20, vocab - 7)
    assert tokens[6].item() == vocab - 20


@gpu
def test_a_bitmask_draw_follows_the_masked_softmax(device):
    from modelfleet.dataplane.kernels.sampling import TokenBitmask, sample_tokens

    row = torch.tensor(SMALL_LOGITS, device=device)
    rows = 4000
    allowed = [0, 2, 3, 6]
    word = sum(1 << i for i in allowed)
    bits = torch.full((rows, 1), word, dtype=torch.int32, device=device)
    no_far = torch.zeros(0, dtype=torch.int32, device=device)
    mask = TokenBitmask(bits, len(SMALL_LOGITS), no_far, torch.ones(rows, dtype=torch.int32, device=device))
    tokens, _ = sample_tokens(
        row.expand(rows, -1).contiguous(),
        torch.ones(rows, device=device),
        distinct_seeds(rows, salt=5).to(device),
        mask=mask,
    )
    kept = torch.full_like(row, float("-inf"))
    kept[allowed] = row[allowed]
    assert_draws_follow(tokens, kept, 1.0)


@gpu
def test_a_bad_bitmask_is_refused(device):
    from modelfleet.dataplane.kernels.sampling import TokenBitmask, sample_tokens

    logits = torch.randn(2, 100, device=device)
    temperature, seeds = torch.zeros(2, device=device), torch.arange(2, device=device)
    none_far = torch.zeros(0, dtype=torch.int32, device=device)
    flags = torch.ones(2, dtype=torch.int32, device=device)
    few = TokenBitmask(torch.zeros(2, 3, dtype=torch.int32, device=device), 100, none_far, flags)
    with pytest.raises(ValueError, match="3 words a row, too few for 100 ids"):
        sample_tokens(logits, temperature, seeds, mask=few)
    wrong_rows = TokenBitmask(torch.zeros(3, 4, dtype=torch.int32, device=device), 100, none_far, flags)
    with pytest.raises(ValueError, match=r"mask.bits must be int32 \[2, words\]"):
        sample_tokens(logits, temperature, seeds, mask=wrong_rows)
    bits = torch.zeros(2, 4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"mask.masked_rows must be int32 \[2\]"):
        sample_tokens(logits, temperature, seeds, mask=TokenBitmask(bits, 100, none_far, flags[:1]))


def test_native_bitmask_reference_reads_bits_and_far_ids():
    from modelfleet.dataplane.kernels.sampling import TokenBitmask

    from tests.dataplane.kernels.reference import bitmask_allowed

    # 40 direct ids, far stop 45 as grammar id 40; bit 31 (the sign bit) and bit 40 set, and 3
    bits = torch.tensor([[-(2**31) | (1 << 3), 1 << 8]], dtype=torch.int32)
    mask = TokenBitmask(bits.expand(2, -1), 40, torch.tensor([45], dtype=torch.int32), torch.tensor([1, 0]))
    allowed = bitmask_allowed(mask, 48)
    assert allowed[0].nonzero().flatten().tolist() == [3, 31, 45]
    assert allowed[1].all()  # a free row
