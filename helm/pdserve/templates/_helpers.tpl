{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Common labels; call with (dict "ctx" $ "component" "prefill"). */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{ include "pdserve.selectorLabels" . }}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Registry URL every node and the router talks to. */}}
{{- define "pdserve.registryUrl" -}}
{{- printf "http://%s-registry:%v" (include "pdserve.fullname" .) .Values.registry.port -}}
{{- end -}}

{{- define "pdserve.tokenSecretName" -}}
{{- default (printf "%s-registry-token" (include "pdserve.fullname" .)) .Values.registry.auth.existingSecret -}}
{{- end -}}

{{/* The registry's --store value: "internal", "external" or "memory". */}}
{{- define "pdserve.storeKind" -}}
{{- if .Values.redis.enabled -}}internal{{- else if .Values.externalRedis.url -}}external{{- else -}}memory{{- end -}}
{{- end -}}

{{/* Env vars shared by nodes and the router: the pod's IP/name and the registry token. */}}
{{- define "pdserve.commonEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PYTHONUNBUFFERED
  value: "1"
{{- if .Values.registry.auth.enabled }}
- name: PDSERVE_REGISTRY_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.tokenSecretName" . }}
      key: token
{{- end }}
{{- end -}}

{{/* Pod annotations: Prometheus scrape hints plus the tier's own; (dict "ctx" $ "port" N "extra" map). */}}
{{- define "pdserve.podAnnotations" -}}
{{- $ann := dict -}}
{{- if .ctx.Values.metrics.podAnnotations -}}
{{- $_ := set $ann "prometheus.io/scrape" "true" -}}
{{- $_ := set $ann "prometheus.io/port" (.port | toString) -}}
{{- $_ := set $ann "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- $ann = merge (deepCopy (.extra | default dict)) $ann -}}
{{- if $ann }}{{ toYaml $ann }}{{ end -}}
{{- end -}}

{{/* /health probes; call with (dict "port" "http" "startup" .Values.pd.startupProbe). */}}
{{- define "pdserve.probes" -}}
{{- if .startup }}
startupProbe:
  httpGet:
    path: /health
    port: {{ .port }}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
{{- end }}
livenessProbe:
  httpGet:
    path: /health
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
readinessProbe:
  httpGet:
    path: /health
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 3
{{- end -}}

{{/* Model volumes (pod level) for the tiers that load the model. */}}
{{- define "pdserve.modelVolumes" -}}
{{- if .Values.model.volume }}
- name: models
{{ toYaml .Values.model.volume | indent 2 }}
{{- end }}
{{- if and .Values.model.prepare (not .Values.model.volume) }}
- name: model-cache
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "pdserve.modelMounts" -}}
{{- if .Values.model.volume }}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ .Values.model.readOnly }}
{{- end }}
{{- if and .Values.model.prepare (not .Values.model.volume) }}
- name: model-cache
  mountPath: {{ .Values.model.cacheDir }}
{{- end }}
{{- end -}}

{{/* Init step converting a built-in model into the cache dir (model.prepare). */}}
{{- define "pdserve.modelInit" -}}
{{- if .Values.model.prepare }}
initContainers:
  - name: prepare-model
    image: {{ include "pdserve.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["pdserve"]
    args:
      - generate
      - --model
      - {{ .Values.model.name | quote }}
      - --model-cache-dir
      - {{ .Values.model.cacheDir | quote }}
      - --device
      - cpu
      - --max-new-tokens
      - "1"
      - --prompt
      - warmup
    {{- with .Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      {{- if .Values.model.volume }}
      - name: models
        mountPath: {{ .Values.model.mountPath }}
      {{- else }}
      - name: model-cache
        mountPath: {{ .Values.model.cacheDir }}
      {{- end }}
{{- end }}
{{- end -}}
