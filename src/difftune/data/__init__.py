"""Data: discovery of images and captions, bucket math, decoding and cropping, latent and text caches,
the batch sampler. Receives encoders as callables; never imports `difftune.models`."""
