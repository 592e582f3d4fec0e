"""Command lines and scripts that start a plan: torchrun per node, sbatch, other frameworks' flags."""
