"""workers.methods.context_cut: a micro-batch's rows cut into a CP group's equal contiguous slices. The ranks'
slices put back together are the row padded to a multiple of the group (padding carries no loss; in a packed row
it is a sequence of its own), positions stay global, and each rank's labels run one token past its slice. A
seq_len_schedule keeps the job's CP size for every stage: a shorter stage's rows are cut the same way."""

import pytest
import torch

from moetune.workers.methods.batch import IGNORE, PACKED_OFFSETS, Batch
from moetune.workers.methods.context_cut import cut_for_context


def _parts(batch: Batch, size: int, min_tokens: int = 1):
    return [cut_for_context(batch, size, rank, pad_id=0, min_tokens=min_tokens) for rank in range(size)]


@pytest.mark.parametrize("length, size, min_tokens, padded", [(7, 2, 1, 8), (16, 4, 1, 16), (5, 2, 3, 6)])
def test_rows_are_padded_to_equal_slices_with_global_positions_and_the_next_label(length, size, min_tokens,
                                                                                  padded):
    ids = torch.arange(1, 2 * length + 1).view(2, length)
    parts = _parts(Batch({"input_ids": ids}, ids + 100, 2 * length), size, min_tokens)
    tokens = torch.cat([part.inputs["input_ids"] for part, _ in parts], dim=1)
    assert tokens.tolist() == torch.nn.functional.pad(ids, (0, padded - length)).tolist()
    positions = torch.cat([part.inputs["position_ids"] for part, _ in parts], dim=1)
    assert positions.tolist() == [list(range(padded))] * 2
    labels = torch.nn.functional.pad(ids + 100, (0, padded - length + 1), value=IGNORE)
    for part, layout in parts:
        assert layout.end - layout.start == padded // size
        assert part.labels.tolist() == labels[:, layout.start:layout.end + 1].tolist()
        assert part.tokens == 2 * length  # the examples' count, once per CP group


def test_a_packed_row_s_padding_is_a_sequence_of_its_own():
    ids = torch.arange(1, 8)[None]
    batch = Batch({"input_ids": ids, PACKED_OFFSETS: torch.tensor([0, 3, 7])}, ids, 7)
    parts = _parts(batch, 2)
    assert [layout.cu_seqlens for _, layout in parts] == [(0, 3, 7, 8)] * 2
    assert [part.inputs[PACKED_OFFSETS].tolist() for part, _ in parts] == [[0, 3, 4], [0, 3, 4]]


def test_a_micro_batch_with_more_than_token_ids_is_refused():
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="token ids only"):
        cut_for_context(Batch({"input_ids": ids, "pixel_values": torch.zeros(1)}, ids, 4), 2, 0, pad_id=0)
