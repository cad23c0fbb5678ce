"""Training: the LightningModule, callbacks, distributed strategies and config composition.

The one layer that knows Lightning; model code never imports it.
"""
