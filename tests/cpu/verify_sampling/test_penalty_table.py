# SPDX-License-Identifier: Apache-2.0
"""The penalty table's rows over requests' lives: filled from the output before the root,
advanced by each step's commits exactly as a table refilled from the longer output would be,
reused after a request finishes, refilled after a retraction, grown on demand."""

import torch
from _upstream import VOCAB, Req, params

from sglang.srt.speculative.verify_sampling.penalty_table import PenaltyTable, output_before_root

PEN = dict(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.2, min_new_tokens=5,
           stop_token_ids={7, 9})  # fmt: skip


def _row(table, pen, i):
    r = int(pen.rows[i])
    return dict(counts=table.counts[r].clone(), out_len=int(table.out_len[r]), freq=float(table.frequency[r]),
                pres=float(table.presence[r]), rep=float(table.repetition[r]), min_new=int(table.min_new_tokens[r]),
                stops=sorted(int(t) for t in table.stop_ids[r] if t >= 0))  # fmt: skip


def test_rows_are_filled_from_the_output_before_the_root():
    table = PenaltyTable(VOCAB, "cpu")
    plain = Req(params(), [1], [4])
    # overlap scheduling: the prefill's root is not in output_ids yet
    a = Req(params(**PEN), [1, 2], [], pool_idx=3, prefilled_outputs=0)
    # retracted and prefilled again: 3 outputs in its KV, the new root already appended
    b = Req(params(**PEN), [1, 2], [5, 5, 6, 8], pool_idx=4, prefilled_outputs=3)
    assert output_before_root(b) == [5, 5, 6]
    pen = table.rows_for([plain, a, b])
    assert int(pen.rows[0]) == -1
    ra, rb = _row(table, pen, 1), _row(table, pen, 2)
    assert ra["out_len"] == 0 and int(ra["counts"].sum()) == 0
    assert rb["out_len"] == 3 and rb["counts"][5] == 2 and rb["counts"][6] == 1 and int(rb["counts"].sum()) == 3
    assert rb["freq"] == 0.5 and rb["pres"] == 0.25 and abs(rb["rep"] - 1.2) < 1e-6 and rb["min_new"] == 5
    assert rb["stops"] == [1, 3, 7, 9]  # its stop ids, the tokenizer's additional stops and EOS
    assert table.rows_for([plain]) is None


def test_commit_advances_rows_as_a_refill_would():
    gen = torch.Generator().manual_seed(0)
    table = PenaltyTable(VOCAB, "cpu")
    reqs = [Req(params(**PEN), [1], [2, 3, 3], pool_idx=i, prefilled_outputs=2) for i in range(3)]
    pen = table.rows_for(reqs)
    root = torch.tensor([3, 3, 3])
    emitted = torch.randint(0, VOCAB, (3, 5), generator=gen)
    num = torch.tensor([1, 3, 5], dtype=torch.int32)
    table.commit(pen, root, emitted, num)
    again = table.rows_for(reqs)  # same rows: the requests keep them
    assert torch.equal(again.rows, pen.rows)
    fresh = PenaltyTable(VOCAB, "cpu")
    for i, r in enumerate(reqs):
        # the output before the next root: the old history, the root, the accepted drafts
        history = r.output_ids[:2] + [3] + emitted[i, : int(num[i]) - 1].tolist()
        ref = Req(r.sampling_params, [1], history + [int(emitted[i, int(num[i]) - 1])], prefilled_outputs=len(history))
        want = _row(fresh, fresh.rows_for([ref]), 0)
        got = _row(table, again, i)
        assert torch.equal(got["counts"], want["counts"]) and got["out_len"] == want["out_len"], i


def test_rows_are_reused_after_finish_and_refilled_after_retraction():
    table = PenaltyTable(VOCAB, "cpu")
    reqs = [Req(params(**PEN), [1], [4], pool_idx=i, prefilled_outputs=0) for i in range(8)]
    table.rows_for(reqs)
    assert table.capacity == 8
    reqs[0].done = True
    newcomer = Req(params(**PEN), [1], [5, 6], pool_idx=0, prefilled_outputs=1)
    pen = table.rows_for(reqs[1:] + [newcomer])
    assert table.capacity == 8  # the finished request's row was taken over
    assert int(pen.rows[-1]) == int(getattr(reqs[0], "_verify_penalty_row")[2])
    assert _row(table, pen, 7)["counts"][5] == 1 and int(_row(table, pen, 7)["counts"].sum()) == 1
    # a retracted request comes back with a fresh row, filled from its longer output
    r = reqs[3]
    r.retraction_count += 1
    r.output_ids = [4, 8, 8]
    r.full_untruncated_fill_ids = r.origin_input_ids + [4, 8]
    pen = table.rows_for([r])
    row = _row(table, pen, 0)
    assert row["out_len"] == 2 and row["counts"][8] == 1 and row["counts"][4] == 1
    # more live requests than rows: the table grows
    many = [Req(params(**PEN), [1], [4], pool_idx=100 + i, prefilled_outputs=0) for i in range(20)]
    pen = table.rows_for(many)
    assert table.capacity >= 20 and len(set(pen.rows.tolist())) == 20
