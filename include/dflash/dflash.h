// The whole public API of dflash in one include: Session and its options (session.h), sampling
// parameters, outputs and metrics, statistics, exceptions and the version.
#pragma once

#include "dflash/errors.h"
#include "dflash/outputs.h"
#include "dflash/sampling_params.h"
#include "dflash/session.h"
#include "dflash/stats.h"
#include "dflash/version.h"
