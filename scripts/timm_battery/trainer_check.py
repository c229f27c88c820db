"""A real ``transformers.Trainer`` run on a vitlab model (scripts/timm_battery.sh): gradient checkpointing on,
checkpoints saved; every checkpoint folder and the final ``save_model()`` folder load back with
``vitlab.from_pretrained`` / ``vitlab.create_model(checkpoint_path=)`` giving the trained model's logits."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

import vitlab
from vitlab.interop.hf import TrainerModel, save_callback


class Images(torch.utils.data.Dataset):
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def main() -> int:
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", num_classes=4)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        args = transformers.TrainingArguments(
            output_dir=str(out),
            max_steps=4,
            per_device_train_batch_size=8,
            save_steps=2,
            logging_steps=2,
            gradient_checkpointing=True,
            report_to=[],
            use_cpu=True,
            learning_rate=1e-3,
        )
        trainer = transformers.Trainer(
            model=TrainerModel(model), args=args, train_dataset=Images(), callbacks=[save_callback()]
        )
        trainer.train()
        assert model.grad_checkpointing, "the Trainer did not switch gradient checkpointing on"
        trainer.save_model(str(out))
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            expected = model.eval()(x)
            for folder in (out, out / "checkpoint-4"):
                for loaded in (
                    vitlab.from_pretrained(folder),
                    vitlab.create_model("deit_mini", checkpoint_path=folder),
                ):
                    got = loaded.eval()(x)
                    assert torch.equal(got, expected), f"{folder}: logits differ by {(got - expected).abs().max()}"
    print(f"transformers {transformers.__version__}: Trainer checkpoints and save_model() load back, identical logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
