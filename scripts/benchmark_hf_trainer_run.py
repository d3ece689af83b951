"""transformers' Trainer on the two workloads of benchmark_hf_trainer.py's (h), written as a Trainer user writes it:
the csv read with `datasets`, tokenized with the tokenizer.json, the model built from its config (fresh weights, no
download), `Trainer(...).train()`. benchmark_hf_trainer.py runs it as a whole command (start-up to exit) and imports
`build_trainer` for the loop's throughput; hydraloop gets the same settings from the constants here.

    python scripts/benchmark_hf_trainer_run.py {bert,gpt2} CSV TOKENIZER_JSON [--epochs 3] [--equal-work]
                                              [--evaluate] [--device auto] [--precision 32]

With --evaluate it prints the last evaluation's metrics (the loss, and the classifier's accuracy) on a line of its own,
`EVALUATION {...}`.

It imports torch, transformers and datasets only, as such a script does: its start-up is a Trainer user's.
"""

import argparse
import json
import tempfile

import transformers
from datasets import load_dataset
from transformers import (
    AutoConfig,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

BLOCK = 64  # tokens a text is truncated to (data.block_size), and the models' positions
# The two models (model.auto_class, model.model_type, +model.config.*): 2 layers of 64 with 4 heads, and each
# architecture's default dropout of 0.1 everywhere (BERT: hidden, attention, classifier head; GPT-2: embeddings,
# residuals, attention).
MODELS = {
    "bert": (
        "AutoModelForSequenceClassification",
        "bert",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "intermediate_size": 256,
            "max_position_embeddings": BLOCK,
        },
    ),
    "gpt2": ("AutoModelForCausalLM", "gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": BLOCK}),
}
# The recipe both loops train with: batch, AdamW's learning rate and decay (none on biases and norm weights:
# Trainer's grouping, hydraloop's optimizer.no_weight_decay=true), a constant learning rate, gradients clipped to a
# norm of 1 (Trainer's default), the seed, and data=hf's held-out share (the same rows: the same split and seed).
BATCH, LR, WEIGHT_DECAY, CLIP, SEED, VAL_FRACTION = 32, 1e-3, 0.01, 1.0, 0, 0.1
PAD = "<pad>"


def tokenized_splits(workload: str, csv: str, tokenizer: PreTrainedTokenizerFast):
    """(train, val) of the csv, as data=hf splits and tokenizes it: input ids and the attention mask (no token type
    ids: GPT-2 would add embeddings for them), truncated to BLOCK; the classifier's labels numbered in sorted order."""
    splits = load_dataset("csv", data_files={"train": csv})["train"].train_test_split(
        test_size=VAL_FRACTION, seed=SEED, shuffle=True
    )
    names = sorted(set(splits["train"]["label"]) | set(splits["test"]["label"]))

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch["text"], truncation=True, max_length=BLOCK, return_token_type_ids=False)
        if workload == "bert":
            encoded["labels"] = [names.index(name) for name in batch["label"]]
        return encoded

    tokenized = splits.map(encode, batched=True, remove_columns=["text", "label"])
    return tokenized["train"], tokenized["test"], len(names)


def build_trainer(
    workload: str,
    csv: str,
    tokenizer_json: str,
    epochs: int,
    *,
    equal_work: bool,
    evaluate: bool,
    device: str,
    precision: str,
    output_dir: str,
    callbacks: list | None = None,
) -> Trainer:
    """The Trainer: its defaults but for the recipe above and these. `report_to="none"` (v5's default; v4's reported
    to every installed tracker) and `save_strategy="no"` (its default, every 500 steps, also saves at the last
    step). `equal_work` turns off what hydraloop's loop does not do: the progress bar, logging (every 500 steps) and
    the NaN/inf filter of the logged loss (a host sync per step). `evaluate`: the loss on the held-out rows after
    each epoch, as hydraloop validates. Batches padded to their own longest text, the last incomplete one dropped
    (hydraloop's data.drop_last=true), as hydraloop's."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, pad_token=PAD)
    train, val, classes = tokenized_splits(workload, csv, tokenizer)
    auto_class, model_type, sizes = MODELS[workload]
    labels = {"num_labels": classes} if workload == "bert" else {}
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **sizes, **labels
    )
    transformers.set_seed(SEED)
    model = getattr(transformers, auto_class).from_config(config)
    arguments = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        num_train_epochs=epochs,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        lr_scheduler_type="constant",
        max_grad_norm=CLIP,
        seed=SEED,
        dataloader_drop_last=True,
        use_cpu=device == "cpu",
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        report_to="none",
        save_strategy="no",
        eval_strategy="epoch" if evaluate else "no",
        disable_tqdm=equal_work,  # False is what its default (None) resolves to at transformers' default verbosity
        logging_strategy="no" if equal_work else "steps",
        logging_nan_inf_filter=not equal_work,
    )
    collator = (
        DataCollatorWithPadding(tokenizer)
        if workload == "bert"
        else DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels: the ids, padding ignored (-100)
    )
    return Trainer(
        model=model,
        args=arguments,
        data_collator=collator,
        train_dataset=train,
        eval_dataset=val if evaluate else None,
        callbacks=callbacks,
        compute_metrics=accuracy if evaluate and workload == "bert" else None,  # hydraloop's val/acc
    )


def accuracy(prediction) -> dict[str, float]:
    """The classifier's share of held-out lines whose play it names."""
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def last_evaluation(trainer: Trainer) -> dict[str, float]:
    """The metrics of the evaluation after the last epoch ({} without --evaluate)."""
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    return evaluations[-1] if evaluations else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=list(MODELS))
    parser.add_argument("csv")
    parser.add_argument("tokenizer")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--equal-work", action="store_true")
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(
            args.workload,
            args.csv,
            args.tokenizer,
            args.epochs,
            equal_work=args.equal_work,
            evaluate=args.evaluate,
            device=args.device,
            precision=args.precision,
            output_dir=output_dir,
        )
        trainer.train()
    # The results, for benchmark_hf_trainer.py to set beside hydraloop's metrics.json.
    print("EVALUATION " + json.dumps(last_evaluation(trainer)))


if __name__ == "__main__":
    main()
