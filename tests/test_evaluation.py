"""The one scorer (normlab.train.evaluation) and the one rows -> padded batches path (normlab.data.sources) against
plain loops: orders, widths, batch sizes, batch statistics, rows without labels. Tiny models, no training, no
kernels."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model import NormLabConfig, NormLabForSequenceClassification
from normlab.data.batching import ROW_ORDERS, pad_rows, row_batches, row_order
from normlab.train.evaluation import evaluate, in_row_order, score_batches

PAD = 0
LENGTHS = [5, 3, 7, 3, 4, 6, 2, 5, 3]  # ties, so a stable sort is visible


def make_rows(labels=True) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate(LENGTHS):
        row = {"input_ids": torch.randint(5, 40, (n,), generator=g).tolist(), "index": i}
        if labels:
            row["labels"] = i % 2
        rows.append(row)
    return rows


def tiny_model(norm="masked_batchnorm") -> NormLabForSequenceClassification:
    torch.manual_seed(0)
    config = NormLabConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, norm=norm, norm_placement="pre", pad_token_id=PAD,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16)
    model = NormLabForSequenceClassification(config)
    with torch.no_grad():  # running statistics away from (0, 1), so running and batch statistics differ
        model.train()(**pad_rows([{"input_ids": r["input_ids"]} for r in make_rows()], PAD))
    return model.eval()


def reference_scores(model, rows, order, batch_size, width=None) -> dict:
    """A plain loop: the rows in `order`, batch_size at a time, padded by hand; per-row results in row order."""
    idx = {"given": list(range(len(rows))), "sorted": sorted(range(len(rows)), key=lambda i: LENGTHS[i]),
           "shuffled": np.random.default_rng(7).permutation(len(rows)).tolist()}[order]
    loss, prediction = torch.zeros(len(rows)), torch.zeros(len(rows), dtype=torch.long)
    for start in range(0, len(idx), batch_size):
        part = idx[start:start + batch_size]
        w = width or max(LENGTHS[i] for i in part)
        ids = torch.full((len(part), w), PAD)
        mask = torch.zeros(len(part), w, dtype=torch.long)
        for r, i in enumerate(part):
            ids[r, :LENGTHS[i]] = torch.tensor(rows[i]["input_ids"])
            mask[r, :LENGTHS[i]] = 1
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        loss[part] = F.cross_entropy(logits, torch.tensor([rows[i]["labels"] for i in part]), reduction="none")
        prediction[part] = logits.argmax(-1)
    return {"loss": loss, "prediction": prediction}


def test_row_order():
    assert row_order(LENGTHS, "given") == list(range(len(LENGTHS)))
    assert row_order(LENGTHS, "sorted") == [6, 1, 3, 8, 4, 0, 7, 5, 2]  # stable: equal lengths keep their order
    shuffled = row_order(LENGTHS, "shuffled", seed=7)
    assert shuffled == np.random.default_rng(7).permutation(len(LENGTHS)).tolist() == row_order(LENGTHS, "shuffled", 7)
    assert shuffled != row_order(LENGTHS, "shuffled", seed=8)
    with pytest.raises(ValueError, match="order='random' is not valid; choose one of: given, sorted, shuffled"):
        row_order(LENGTHS, "random")
    assert ROW_ORDERS == ("given", "sorted", "shuffled")


def test_pad_rows():
    rows = [{"input_ids": [7, 8, 9], "token_type_ids": [0, 1, 1], "labels": 1, "index": 4, "length": 3},
            {"input_ids": [5], "token_type_ids": [0], "labels": 0, "index": 2, "length": 1}]
    batch = pad_rows(rows, pad_id=3)
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels", "index"}  # `length` dropped
    assert batch["input_ids"].tolist() == [[7, 8, 9], [5, 3, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["token_type_ids"].tolist() == [[0, 1, 1], [0, 0, 0]]
    assert batch["labels"].tolist() == [1, 0] and batch["index"].tolist() == [4, 2]
    assert all(t.dtype == torch.long for t in batch.values())
    assert pad_rows(rows, 3, multiple_of=8)["input_ids"].shape == (2, 8)
    assert pad_rows(rows, 3, width=5)["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="cannot pad to width 2: a row has 3 tokens"):
        pad_rows(rows, 3, width=2)


@pytest.mark.parametrize("order,batch_size,width", [("given", 4, None), ("sorted", 3, None), ("shuffled", 2, None),
                                                    ("sorted", 4, 8), ("given", 100, None)])
def test_row_batches_take_the_rows_in_order(order, batch_size, width):
    rows = make_rows()
    batches = list(row_batches(rows, batch_size, PAD, order=order, width=width, seed=7))
    idx = row_order(LENGTHS, order, seed=7)
    assert [b["index"].tolist() for b in batches] == [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    for b in batches:
        longest = max(LENGTHS[i] for i in b["index"].tolist())
        assert b["input_ids"].shape[1] == (width or longest)
        assert b["attention_mask"].sum(1).tolist() == [LENGTHS[i] for i in b["index"].tolist()]


@pytest.mark.parametrize("order,batch_size,width", [("given", 4, None), ("sorted", 3, None), ("shuffled", 2, None),
                                                    ("sorted", 3, 8)])
def test_scorer_matches_a_plain_loop(order, batch_size, width):
    model, rows = tiny_model(), make_rows()
    expected = reference_scores(model, rows, order, batch_size, width)
    loader = row_batches(rows, batch_size, PAD, order=order, width=width, seed=7)
    got = in_row_order(score_batches(None, model, loader), ("loss", "prediction", "label", "confidence", "count"))
    assert torch.equal(got["loss"], expected["loss"]) and torch.equal(got["prediction"], expected["prediction"])
    assert got["label"].tolist() == [r["labels"] for r in rows] and got["count"].tolist() == [1.0] * len(rows)
    assert (got["confidence"] >= 0.5).all() and (got["confidence"] <= 1).all()  # the argmax of two classes
    metrics = evaluate(None, model, loader, "classification", seed=0)
    # rel: evaluate sums each batch in float32 before adding the batches in float64
    assert metrics["eval/loss"] == pytest.approx(expected["loss"].double().mean().item(), rel=1e-6)
    labels = torch.tensor([r["labels"] for r in rows])
    assert metrics["eval/accuracy"] == (expected["prediction"] == labels).double().mean().item()


def test_scorer_batch_statistics_mode():
    model, rows = tiny_model(), make_rows()
    loader = row_batches(rows, 3, PAD, order="sorted")
    running = in_row_order(score_batches(None, model, loader), ("loss",))["loss"]
    batch = in_row_order(score_batches(None, model, loader, batch_stats=True), ("loss",))["loss"]
    assert model.batch_stats_in_eval(True) == 5  # two per block and the final norm
    expected = reference_scores(model, rows, "sorted", 3)["loss"]
    model.batch_stats_in_eval(False)
    assert torch.equal(batch, expected) and not torch.allclose(batch, running)
    assert torch.equal(running, reference_scores(model, rows, "sorted", 3)["loss"])  # switched back afterwards
    assert not model.training
    with pytest.raises(ValueError, match="the layernorm model has no batch-statistics norms"):
        score_batches(None, tiny_model("layernorm"), loader, batch_stats=True)


def test_scorer_rows_without_labels_and_training_mode_restored():
    model, rows = tiny_model(), make_rows(labels=False)
    model.train()
    (scores,) = score_batches(None, model, row_batches(rows, len(rows), PAD))
    assert model.training  # the caller's mode comes back
    assert set(scores) == {"prediction", "confidence", "probabilities", "index"}
    expected = reference_scores(model.eval(), make_rows(), "given", len(rows))["prediction"]
    assert torch.equal(scores["prediction"], expected)
    assert torch.allclose(scores["probabilities"].sum(1), torch.ones(len(rows)))
    assert torch.equal(scores["confidence"], scores["probabilities"].max(1).values)
