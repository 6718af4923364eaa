"""Adapters for other people's trainers and dashboards: TRL, verl, TensorBoard, W&B, MLflow.

Each lives in its own module and imports its library only there (optional extras:
``pip install 'gradscope[trl]'``, ``[verl]``, ``[tensorboard]``, ``[wandb]``, ``[mlflow]``); importing this
package imports none of them. See docs/integrations.md.
"""
