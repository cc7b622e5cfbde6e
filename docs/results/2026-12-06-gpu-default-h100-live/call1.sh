# Call 1 (.whl-a, .stage/part-1): half the wheels and the first asset part.
eval "$(bash launch/stage_assets.sh receive)"
echo "PYTHONPATH=$PYTHONPATH"; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
