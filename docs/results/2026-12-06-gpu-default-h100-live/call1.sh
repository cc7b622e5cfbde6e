# Call 1 (.whl-a, .stage/part-1; again with .whl-b, .stage/part-2): half the wheels and an asset part.
eval "$(bash launch/stage_assets.sh receive)"
echo "PYTHONPATH=$PYTHONPATH"; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
