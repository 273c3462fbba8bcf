# The paper's base model on WMT14 en-de (Table 3, section 5).
# Paper: 8 NVIDIA P100 GPUs, 100k steps of ~0.4 s = 12 hours, 27.3 BLEU (newstest2014, tokenised,
# compound-split: translate.py --paper-bleu). Not run end to end on WMT14 here.
# Prepare the data first: python data_prep.py wmt14 --src en --tgt de
# Batch per GPU, for the paper's ~25000 source + 25000 target tokens per update (section 5.1):
#   8 GPUs: torchrun --nproc_per_node=8 train.py config/wmt_base.py
#           (max_tokens=4096 below: 8 x ~3100 real tokens)
#           at 4096 tokens a step took 40.5 ms compiled, 43.8 ms eager on an H100 (the host sets
#           the pace at this size: docs/performance.md)
#   1 GPU:  python train.py config/wmt_base.py --max_tokens=25000 --compile=True
#           one 25k-token step took 47.3 ms compiled (20% MFU) on an H200; on an H100 67 ms eager
#           against 8 x 40 ms for the eight 4096-token micro-steps of --update_freq=8
#           (docs/performance.md)
data_dir = 'data/wmt14_en_de'
out_dir = 'out/wmt_base'
n_enc_layers = 6
n_dec_layers = 6
d_model = 512
d_ff = 2048
n_heads = 8
dropout = 0.1
# ~25000 source + 25000 target tokens per step (section 5.1): 8 GPUs x 4096 padded tokens, of which
# roughly 3100 are real after length bucketing.
max_tokens = 4096
update_freq = 1
max_steps = 100000
schedule = 'noam'  # lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
warmup = 4000
beta1 = 0.9
beta2 = 0.98
adam_eps = 1e-9
label_smoothing = 0.1
dtype = 'bfloat16'
compile = True  # see the batch per GPU above
# Section 6.1: checkpoints every 10 minutes, the last 5 averaged.
save_interval = 0
save_minutes = 10.0
keep_last = 5
average_last = 5
log_interval = 100
eval_interval = 2000
bleu_interval = 10000
