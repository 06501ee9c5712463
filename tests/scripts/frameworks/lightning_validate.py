"""The Lightning client with a validation loop: Lightning's sanity check before training, then validation every 4
steps; OUT_DIR/rank{r}.json as report.py writes it."""

from lightning_mlp import main

if __name__ == "__main__":
    main(validate=True)
