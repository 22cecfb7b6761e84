"""Where the training pipeline finds its prompt sets."""

from dspark_serve.training.data import PROMPTS_DIR, TRAIN_PROMPTS, dev_sets


def test_the_vendored_prompt_sets_are_where_the_pipeline_looks():
    assert TRAIN_PROMPTS.is_file() and TRAIN_PROMPTS.parent == PROMPTS_DIR
    assert {"gsm8k", "mt-bench"} <= set(dev_sets())
