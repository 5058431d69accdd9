# Port of TRL's `examples/scripts/ppo/ppo.py` (last shipped with TRL 1.12) to `trl_trainers`.
# Differences from the original: the import line (`trl_trainers` instead of `trl.experimental.ppo`, and
# `get_kbit_device_map`, gone from TRL >= 1.13, defined below), and `_load_or_build_tiny`, which builds tiny local
# models, tokenizer and prompts when no hub is reachable (HF_HUB_OFFLINE=1 or a failed download), so the script runs
# on an offline CPU machine.
"""
python examples/ppo/ppo.py \
    --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
    --dataset_train_split descriptiveness \
    --learning_rate 3e-6 \
    --output_dir pythia-1b-deduped-descriptiveness-sentiment-trl-style-ppo \
    --per_device_train_batch_size 64 \
    --gradient_accumulation_steps 1 \
    --total_episodes 10000 \
    --model_name_or_path EleutherAI/pythia-1b-deduped \
    --missing_eos_penalty 1.0

Offline smoke run (tiny local models, CPU, a few seconds):

HF_HUB_OFFLINE=1 python examples/ppo/ppo.py --output_dir /tmp/ppo-tiny --total_episodes 64 \
    --per_device_train_batch_size 8 --response_length 8 --num_ppo_epochs 1 --bf16 False --report_to none \
    --gradient_checkpointing False --missing_eos_penalty 1.0 --num_sample_generations 0
"""

import os
import shutil

import torch
from accelerate import PartialState
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser
from trl import ModelConfig, ScriptArguments, get_peft_config, get_quantization_config

from trl_trainers import PPOConfig, PPOTrainer


def get_kbit_device_map():
    return {"": PartialState().local_process_index} if torch.cuda.is_available() else None


def _load_or_build_tiny(load_hub):
    """Run `load_hub()`; when the hub is unreachable, return tiny local models/tokenizer/prompts instead."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True"):
        try:
            return load_hub()
        except OSError:
            pass
    from trl_trainers.testing import char_tokenizer, prompt_dataset, tiny_causal_lm, tiny_value_model

    tokenizer = char_tokenizer()
    dataset = prompt_dataset(tokenizer, n=164, seed=0).map(lambda x: {"prompt": tokenizer.decode(x["input_ids"])})
    return {
        "tokenizer": tokenizer,
        "value_model": tiny_value_model(len(tokenizer), seed=1),
        "reward_model": tiny_value_model(len(tokenizer), seed=2),
        "policy": tiny_causal_lm(len(tokenizer), seed=0),
        "ref_policy": tiny_causal_lm(len(tokenizer), seed=0),
        "dataset": dataset.remove_columns("input_ids"),
    }


if __name__ == "__main__":
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()
    # remove output_dir if exists
    shutil.rmtree(training_args.output_dir, ignore_errors=True)

    ################
    # Model & Tokenizer
    ################
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    quantization_config = get_quantization_config(model_args)
    model_kwargs = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
        device_map=get_kbit_device_map() if quantization_config is not None else None,
        quantization_config=quantization_config,
    )
    peft_config = get_peft_config(model_args)

    def load_hub():
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path, padding_side="left", trust_remote_code=model_args.trust_remote_code
        )
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        value_model = AutoModelForSequenceClassification.from_pretrained(
            training_args.reward_model_path, trust_remote_code=model_args.trust_remote_code, num_labels=1
        )
        reward_model = AutoModelForSequenceClassification.from_pretrained(
            training_args.reward_model_path, trust_remote_code=model_args.trust_remote_code, num_labels=1
        )
        policy = AutoModelForCausalLM.from_pretrained(
            training_args.sft_model_path, trust_remote_code=model_args.trust_remote_code
        )
        ref_policy = None
        if peft_config is None:
            ref_policy = AutoModelForCausalLM.from_pretrained(
                training_args.sft_model_path, trust_remote_code=model_args.trust_remote_code
            )
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, split=script_args.dataset_train_split
        )
        return dict(tokenizer=tokenizer, value_model=value_model, reward_model=reward_model, policy=policy,
                    ref_policy=ref_policy, dataset=dataset)

    loaded = _load_or_build_tiny(load_hub)
    tokenizer, value_model, reward_model = loaded["tokenizer"], loaded["value_model"], loaded["reward_model"]
    policy, ref_policy = loaded["policy"], loaded["ref_policy"] if peft_config is None else None

    ################
    # Dataset
    ################
    dataset = loaded["dataset"]
    eval_samples = 100
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))
    dataset_text_field = "prompt"

    def prepare_dataset(dataset, tokenizer):
        """pre-tokenize the dataset before training; only collate during training"""

        def tokenize(element):
            outputs = tokenizer(element[dataset_text_field], padding=False)
            return {"input_ids": outputs["input_ids"]}

        return dataset.map(
            tokenize, batched=True, remove_columns=dataset.column_names, num_proc=training_args.dataset_num_proc
        )

    # Compute that only on the main process for faster data processing.
    with PartialState().local_main_process_first():
        train_dataset = prepare_dataset(train_dataset, tokenizer)
        eval_dataset = prepare_dataset(eval_dataset, tokenizer)

    ################
    # Training
    ################
    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    trainer.train()

    # Save and push to hub
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)

    trainer.generate_completions()
